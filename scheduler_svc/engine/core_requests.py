"""The requests one engine core holds, and the client streams that go with them:
queued, moved to or from another worker, aborted, ended with an error. EngineCore
(core.py) is built on this class and sets the attributes declared here."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from scheduler_svc.engine import masks
from scheduler_svc.engine.counters import CoreCounters
from scheduler_svc.engine.errors import SchedulerBug, WorkerCallFailed, WorkerUnavailable
from scheduler_svc.engine.streams import RequestStream, StreamHandle, open_streams
from scheduler_svc.engine.timing import EngineHooks
from scheduler_svc.engine.worker_client import WorkerInfo
from scheduler_svc.planning.plan import StepPlan
from scheduler_svc.planning.planner import Planner
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.structured.errors import GrammarFailed
from scheduler_svc.structured.grammars import Grammars
from scheduler_svc.text.tokenizer import ModelTokenizer

log = structlog.get_logger(__name__)


class CoreRequests:
    info: WorkerInfo
    planner: Planner
    tokenizer: ModelTokenizer
    hooks: EngineHooks[Any]
    grammars: Grammars | None
    streams: dict[str, RequestStream]
    counters: CoreCounters
    healthy: bool
    _wakeup: asyncio.Event

    def add(self, request: Request) -> StreamHandle:
        """Queue a new request (with n > 1: a fork parent and its samples); raises
        RequestRejected, QueueFull or WorkerUnavailable."""
        if not self.healthy:
            raise WorkerUnavailable(f"worker {self.info.address} is unavailable")
        self.planner.add(request)
        handle, streams = open_streams(request, self.tokenizer, self.hooks)
        self.streams.update(streams)
        self.counters.prompt_tokens += request.num_prompt_tokens
        self._wakeup.set()
        return handle

    def adopt(self, request: Request) -> None:
        """Queue a request moved here from a lost worker (its streams follow with
        adopt_streams). It keeps its outputs: prompt + outputs are recomputed and
        generation continues, so the client sees no token twice."""
        if not self.healthy:
            raise WorkerUnavailable(f"worker {self.info.address} is unavailable")
        self.planner.add(request)
        self._wakeup.set()

    def take_requests(self) -> tuple[list[Request], dict[str, RequestStream]]:
        """Give up every live request (oldest first) and the client streams that go
        with them (a request's own, or its parallel samples'), e.g. to another worker."""
        requests = self.planner.drain()
        for request in requests:
            # Block hashes are keyed by this worker's model/dtype; the next pool hashes its own.
            request.block_hashes.clear()
        streams = self._pop_streams(requests)
        self.counters.requests_moved_out += len(requests)
        return requests, streams

    def hand_off(self, request_id: str) -> tuple[Request, dict[str, RequestStream]]:
        """Give up one running request and its client stream (disaggregation: its KV was
        copied to the worker it goes to); its blocks stay in this worker's prefix cache."""
        request = self.planner.hand_off(request_id)
        self.counters.requests_moved_out += 1
        return request, self._pop_streams([request])

    def adopt_streams(self, streams: dict[str, RequestStream]) -> None:
        self.streams.update(streams)

    def _pop_streams(self, requests: list[Request]) -> dict[str, RequestStream]:
        ids = [r.request_id for r in requests] + [c.request_id for r in requests for c in r.children]
        return {rid: self.streams.pop(rid) for rid in ids if rid in self.streams}

    def abort(self, request_id: str) -> bool:
        """Drop a request whose client went away; its blocks are freed now or by
        the update of the step it is in flight in."""
        stream = self.streams.pop(request_id, None)
        aborted = self.planner.abort(request_id)
        if aborted:
            log.info("request aborted", request_id=request_id)
            if stream:
                stream.abort()
        self._wakeup.set()
        return aborted

    def fail_all(self, error: Exception) -> int:
        """End every live request with `error` (worker gone, shutdown); returns how many streams."""
        streams = self._pop_streams(self.planner.drain())
        for request_id, stream in streams.items():
            stream.fail(error)
            log.warning("request failed", request_id=request_id, error=type(error).__name__, reason=str(error))
        self.counters.requests_failed += len(streams)
        return len(streams)

    def _end_failed_grammars(self, failures: list[masks.MaskFailure], step_id: int) -> None:
        """Requests whose grammar failed while their masks were computed end with the error."""
        for failure in failures:
            self.planner.finish(failure.request_id, FinishReason.ABORT)
            self._fail_request(failure.request_id, GrammarFailed(failure.error), step_id)

    def _fail_request(self, request_id: str, error: Exception, step_id: int | None = None) -> None:
        """End one request's stream with `error` (the planner has ended the request). A grammar
        that failed is compiled afresh for the next request: its lexer states are spent."""
        if isinstance(error, GrammarFailed) and self.grammars is not None:
            request = self.streams[request_id].request if request_id in self.streams else None
            if request is not None and request.grammar is not None:
                self.grammars.forget(request.grammar.grammar.constraint)
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(error)
        self.counters.requests_failed += 1
        log.warning(
            "request failed", request_id=request_id, step_id=step_id, error=type(error).__name__, reason=str(error)
        )

    def _fail_plan(self, plan: StepPlan, err: WorkerCallFailed) -> None:
        """A step the worker refuses will be refused again: end its requests with
        an error rather than retry forever (this is a scheduler bug, logged)."""
        self.planner.requeue_all(reset_prefix_cache=True)
        for request_id in {s.request_id for s in plan.seqs}:
            stream = self.streams.pop(request_id, None)
            self.planner.finish(request_id, FinishReason.ABORT)
            if stream:
                stream.fail(SchedulerBug(f"worker rejected a step: {err.details}"))
