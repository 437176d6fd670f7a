"""Drives one worker: plan a step, run it on the worker, apply the result,
stream the deltas. Everything runs on the asyncio loop, so the planner is only
ever touched from one thread; the worker call is the only await in a step."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc
import structlog

from scheduler_svc.output import RequestStream
from scheduler_svc.planner import Planner, StepPlan
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.tokenizer import ModelTokenizer
from scheduler_svc.worker_client import WorkerClient, WorkerInfo

log = structlog.get_logger(__name__)

# Errors after which the worker may come back: reconnect and recompute.
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.UNKNOWN)


class WorkerUnavailable(RuntimeError):
    """No healthy worker can take the request (the server maps it to UNAVAILABLE)."""


@dataclass
class CoreCounters:
    steps_run: int = 0
    requests_finished: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    worker_failures: int = 0
    last_step_ms: float = 0.0


class EngineCore:
    def __init__(self, client: WorkerClient, info: WorkerInfo, planner: Planner, tokenizer: ModelTokenizer,
                 worker_timeout_s: float):
        self.client = client
        self.info = info
        self.planner = planner
        self.tokenizer = tokenizer
        self.worker_timeout_s = worker_timeout_s
        self.streams: dict[str, RequestStream] = {}
        self.counters = CoreCounters()
        self.healthy = True
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def load(self) -> tuple[int, int]:
        """Smaller is less loaded: queued + running requests, then blocks in use."""
        return self.planner.num_running + self.planner.num_waiting, self.planner.kv.pool.num_used_blocks

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"engine-core-{self.info.address}")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def add(self, request: Request) -> RequestStream:
        if not self.healthy:
            raise WorkerUnavailable(f"worker {self.info.address} is unavailable")
        self.planner.add(request)
        stream = RequestStream(request, self.tokenizer)
        self.streams[request.request_id] = stream
        self.counters.prompt_tokens += request.num_prompt_tokens
        self._wakeup.set()
        return stream

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

    async def _run(self) -> None:
        while True:
            if not self.planner.has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            plan = self.planner.schedule()
            if plan.is_empty:
                # Nothing fits right now (e.g. blocks held by ending requests): wait for a change.
                self._wakeup.clear()
                await _wait_or_timeout(self._wakeup, 0.01)
                continue
            await self._execute(plan)

    async def _execute(self, plan: StepPlan) -> None:
        step_log = log.bind(step_id=plan.step_id, worker=self.info.address)
        started = time.perf_counter()
        try:
            result = await self.client.step(plan)
        except grpc.aio.AioRpcError as err:
            if err.code() in _TRANSIENT:
                step_log.warning("worker step failed", code=err.code().name, details=err.details())
                await self._recover()
            else:
                step_log.error("worker rejected step", code=err.code().name, details=err.details())
                self._fail_plan(plan, err)
            return
        if result.instance_id != self.info.instance_id:
            # The worker restarted between two steps: its cache is empty, so this
            # result was computed over garbage. Forget it and recompute.
            step_log.warning("worker restarted", old=self.info.instance_id, new=result.instance_id)
            self.planner.requeue_all(reset_prefix_cache=True)
            self.info = await self.client.info()
            return
        updates = self.planner.update(plan, result.sampled)
        self.counters.steps_run += 1
        self.counters.last_step_ms = (time.perf_counter() - started) * 1e3
        step_log.debug("step", seqs=len(plan.seqs), tokens=plan.num_tokens, forward_ms=round(result.forward_ms, 2),
                       step_ms=round(self.counters.last_step_ms, 2), preempted=plan.preempted)
        self._dispatch(updates)

    def _dispatch(self, updates) -> None:
        for update in updates:
            self.counters.generation_tokens += len(update.new_token_ids)
            stream = self.streams.get(update.request_id)
            if stream is None:
                continue
            if stream.on_update(update):
                self.planner.finish(update.request_id, FinishReason.STOP)
            if stream.closed:
                del self.streams[update.request_id]
                self.counters.requests_finished += 1
                r = stream.request
                log.info("request finished", request_id=r.request_id, prompt_tokens=r.num_prompt_tokens,
                         cached_tokens=r.num_cached_prompt_tokens, output_tokens=r.num_output_tokens,
                         finish_reason=str(r.finish_reason or FinishReason.STOP),
                         preemptions=r.num_preemptions)

    def _fail_plan(self, plan: StepPlan, err: grpc.aio.AioRpcError) -> None:
        """A step the worker refuses will be refused again: end its requests with
        an error rather than retry forever (this is a scheduler bug, logged)."""
        self.planner.requeue_all(reset_prefix_cache=True)
        for request_id in {s.request_id for s in plan.seqs}:
            stream = self.streams.pop(request_id, None)
            self.planner.finish(request_id, FinishReason.ABORT)
            if stream:
                stream.fail("INTERNAL", f"worker rejected a step: {err.details()}")

    async def _recover(self) -> None:
        """Requeue everything (the worker's cache is gone or suspect) and wait for
        the worker to answer again; past worker_timeout_s, fail the live requests."""
        self.counters.worker_failures += 1
        self.planner.requeue_all(reset_prefix_cache=True)
        self.healthy = False
        deadline = time.monotonic() + self.worker_timeout_s
        info = await self._reconnect(deadline)
        if info is None:
            for request in self.planner.drain():
                stream = self.streams.pop(request.request_id, None)
                if stream:
                    stream.fail("UNAVAILABLE", f"worker {self.info.address} did not come back within "
                                               f"{self.worker_timeout_s}s")
            log.error("worker gone, requests failed", worker=self.info.address)
            info = await self._reconnect(None)
        self._adopt(info)

    async def _reconnect(self, deadline: float | None) -> WorkerInfo | None:
        delay = 0.05
        while deadline is None or time.monotonic() < deadline:
            try:
                return await self.client.info(timeout_s=2.0)
            except grpc.aio.AioRpcError:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        return None

    def _adopt(self, info: WorkerInfo) -> None:
        pool = self.planner.kv.pool
        if (info.num_blocks, info.block_size) != (pool.num_blocks, pool.block_size):
            # Our block ids would not match its pool; stay unhealthy and say why.
            log.error("worker came back with another pool; not using it", worker=info.address,
                      num_blocks=info.num_blocks, expected=pool.num_blocks)
            return
        log.info("worker back", worker=info.address, instance_id=info.instance_id)
        self.info = info
        self.healthy = True
        self._wakeup.set()


async def _wait_or_timeout(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass
