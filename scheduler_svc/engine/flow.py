"""Request flow: a request is routed to one worker of the fleet (engine/router.py
decides which), lives on that worker's core until its client stream ends, and is
handed over with its outputs and stream to another worker if its own is lost."""

from __future__ import annotations

import itertools

import structlog

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.disagg import KvHandoff
from scheduler_svc.engine.errors import WorkerUnavailable
from scheduler_svc.engine.fleet import Fleet
from scheduler_svc.engine.router import Candidate, NoWorkerAvailable, Router
from scheduler_svc.engine.streams import StreamHandle
from scheduler_svc.planning.queues import QueueFull
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import Request

log = structlog.get_logger(__name__)


class RequestFlow:
    def __init__(self, fleet: Fleet, router: Router) -> None:
        self.fleet = fleet
        self.router = router
        self.closed = False  # shutting down: new requests are refused
        self._seq_ids = itertools.count(1)
        # Client request id -> the planner request ids behind its stream (n > 1: a
        # fork parent and its samples), and each of those -> the core it lives on.
        self._members: dict[str, list[str]] = {}
        self._owner: dict[str, EngineCore] = {}
        # Prefill/decode disaggregation: which workers a request is routed among, and its move.
        self.handoff = KvHandoff(fleet, router, self._moved)

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def num_live(self) -> int:
        """Requests whose client stream is still open."""
        return len(self._members)

    def submit(self, request: Request) -> StreamHandle:
        """Queue a request on the worker the router picks (by default: the longest
        cached prefix of its prompt, then the least loaded); raises RequestRejected,
        QueueFull or WorkerUnavailable."""
        if self.closed:
            raise WorkerUnavailable("the scheduler is shutting down")
        if request.request_id in self._members:  # planners only see their own ids
            raise RequestRejected("request_id", f"{request.request_id!r} is already in use")
        core = self._route(request, self.handoff.pool(request, self.fleet.cores))
        handle = core.add(request)
        self._members[request.request_id] = handle.member_ids
        for member_id in handle.member_ids:
            self._owner[member_id] = core
        return handle

    def _route(self, request: Request, cores: list[EngineCore]) -> EngineCore:
        """The router's choice among `cores` (only SERVING ones are eligible)."""
        candidates = [Candidate.from_core(c, self.fleet.state(c)) for c in cores]
        try:
            decision = self.router.route(request, candidates)
        except NoWorkerAvailable as exc:
            raise WorkerUnavailable(str(exc)) from None
        log.debug(
            "request routed",
            request_id=request.request_id,
            worker=decision.address,
            reason=str(decision.reason),
            cached_tokens=decision.cached_tokens,
            expected_cached_tokens=decision.expected_cached_tokens,
        )
        return next(c for c in cores if c.info.address == decision.address)

    def handover(self, source: EngineCore) -> bool:
        """`source` lost its worker: move its live requests, with their outputs so far
        and their client streams, to the serving workers the router picks (a draining
        worker takes nothing new). False (nothing moved) if there is none; the requests
        then wait for `source` to come back."""
        others = [c for c in self.fleet.serving_cores() if c is not source]
        if not others:
            return False
        requests, streams = source.take_requests()
        moved = 0
        for request in requests:
            own = {rid: streams.pop(rid) for rid in _request_ids(request) if rid in streams}
            try:
                target = self._route(request, self.handoff.pool(request, others))
                target.adopt(request)
            except (QueueFull, RequestRejected, WorkerUnavailable) as exc:
                lost = WorkerUnavailable(
                    f"worker {source.info.address} was lost and no other worker could take the request over: {exc}"
                )
                for rid, stream in own.items():
                    stream.fail(lost)
                    self._owner.pop(rid, None)
                continue
            target.adopt_streams(own)
            for rid in _request_ids(request):
                if rid in self._owner:  # not if its client has gone meanwhile
                    self._owner[rid] = target
            moved += 1
            log.info(
                "request moved",
                request_id=request.request_id,
                src=source.info.address,
                dst=target.info.address,
                output_tokens=request.num_output_tokens,
            )
        log.warning(
            "requests moved off a lost worker", worker=source.info.address, moved=moved, failed=len(requests) - moved
        )
        return True

    def _moved(self, request: Request, core: EngineCore) -> None:
        """A request moved (disaggregation) to `core`: aborts follow it there."""
        if request.request_id in self._owner:  # not if its client has gone meanwhile
            self._owner[request.request_id] = core

    def release(self, request_id: str) -> None:
        """The client's stream ended (done, cancelled or timed out): abort what is still live."""
        for member_id in self._members.pop(request_id, ()):
            core = self._owner.pop(member_id, None)
            if core is None:
                continue
            try:
                core.abort(member_id)
            except Exception:  # a planner bug: log it, and still abort the other samples
                log.exception("abort failed", request_id=member_id)


def _request_ids(request: Request) -> list[str]:
    """The request and its parallel samples: each has its own client stream."""
    return [request.request_id, *(c.request_id for c in request.children)]
