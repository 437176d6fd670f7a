"""Drives one worker: plan a step, run it on the worker, apply the result,
stream the deltas. Everything runs on the asyncio loop, so the planner is only
ever touched from one thread; the worker call is the only await in a step.

Worker failure. A step that fails with a transport error (the worker died, was
restarted, or the network dropped) loses the worker: every running request goes
back to the queue, keeping the tokens it already streamed, and will recompute
prompt + outputs. While the worker is lost the core asks the engine to move its
requests to a healthy worker (`handover`); with none, they wait here until the
worker answers again (reconnect with backoff) or `worker_timeout_s` passes, and
then end with UNAVAILABLE. A worker that comes back with a new instance id has
an empty cache, so the prefix index is reset before anything is scheduled.
While idle, the core probes its worker every `health_interval_s`, so a dead or
restarted worker is noticed before the next request is routed to it.

Structured outputs: a step's token masks are computed by the grammar engine's
filler off the event loop (engine/masks.py): before the step is sent for rows
whose input is known, and for rows planned ahead of their input token right
after the step before them is applied (late masks). Late masks ride along with
the next step planned ahead (StepRequest.previous_step_masks), or go in a
StepMasks call of their own when no step follows; the worker runs the forward
meanwhile and waits for them only at sampling.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from scheduler_svc.engine import masks
from scheduler_svc.engine.adapter_loader import AdapterLoader, waiting_for
from scheduler_svc.engine.counters import CoreCounters
from scheduler_svc.engine.errors import SchedulerBug, WorkerCallFailed, WorkerUnavailable
from scheduler_svc.engine.kv_events import WorkerKvEvents
from scheduler_svc.engine.sent import SentStep, abandon
from scheduler_svc.engine.step_budget import SpeedBudget
from scheduler_svc.engine.streams import RequestStream, StreamHandle, open_streams
from scheduler_svc.engine.timing import EngineHooks, RequestTiming
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.kv.block_manager import LeakError
from scheduler_svc.planning.plan import PlanMasks, RequestUpdate, StepPlan
from scheduler_svc.planning.planner import Planner
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.structured.errors import GrammarFailed
from scheduler_svc.structured.grammars import Grammars
from scheduler_svc.text.tokenizer import ModelTokenizer

log = structlog.get_logger(__name__)

_BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.05, 1.0
_PROBE_TIMEOUT_S = 2.0
_STOP_RETRY_S = 1.0


@dataclass(frozen=True)
class CoreOptions:
    worker_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    async_scheduling: bool = True  # plan and send step N+1 while step N runs


# Called by a core that lost its worker, with itself: moves its live requests to
# another worker and returns True, or returns False if no worker can take them.
Handover = Callable[["EngineCore"], bool]
# Called by a core with itself after it streamed a step's tokens (disaggregation: a
# prefill worker's requests whose first token is out leave for a decode worker).
Applied = Callable[["EngineCore"], None]


class EngineCore:
    def __init__(
        self,
        client: WorkerClient,
        info: WorkerInfo,
        planner: Planner,
        tokenizer: ModelTokenizer,
        options: CoreOptions = CoreOptions(),
        handover: Handover | None = None,
        hooks: EngineHooks[EngineCore] = EngineHooks(),
    ):
        self.client = client
        self.info = info
        self.planner = planner
        self.tokenizer = tokenizer
        self.options = options
        self.handover = handover
        self.hooks = hooks
        self.on_applied: Applied | None = None
        self.metrics: object = None  # the observability layer's per-core state; the engine never reads it
        self.grammars: Grammars | None = None  # the fleet's grammar engine (structured outputs)
        self.step_budget: SpeedBudget | None = None  # a CPU worker's budget, sized from its speed (the fleet's)
        self.adapters: AdapterLoader | None = None  # --enable-lora: this worker's adapter slots (the fleet's)
        # Where this worker's prefix-index changes go, a batch per step (the Engine sets its hub's stream).
        self.kv_events = WorkerKvEvents(info.address)
        self.streams: dict[str, RequestStream] = {}
        self.counters = CoreCounters()
        self.healthy = True
        self._lost_at = 0.0
        self._refused_instance = ""
        self._audited_at_step = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_timeout_s(self) -> float:
        return self.options.worker_timeout_s

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"engine-core-{self.info.address}")

    async def stop(self) -> None:
        if self._task:
            # Cancel until it ends: one cancellation may be absorbed by an
            # awaited library call finishing at the same moment.
            while not self._task.done():
                self._task.cancel()
                await asyncio.wait({self._task}, timeout=_STOP_RETRY_S)
            await asyncio.gather(self._task, return_exceptions=True)

    # ---- requests ---------------------------------------------------------
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

    # ---- the step loop ----------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not silently stop this worker's loop
                log.exception("engine core failed; ending its requests", worker=self.info.address)
                self.fail_all(SchedulerBug("internal scheduler error; see the scheduler log"))
                await asyncio.sleep(_BACKOFF_FIRST_S)

    async def _loop(self) -> None:
        while True:
            self._publish_kv_events()  # what a reset (lost or restarted worker) changed
            if not self.healthy:
                await self._recover()
            elif not self.planner.has_work():
                await self._idle()
            elif self.adapters is None or await self._load_adapters():
                plan = self.planner.schedule()
                if plan.is_empty:
                    # Nothing fits right now (e.g. blocks held by ending requests): wait for a change.
                    await self._wait_for_wakeup(0.01)
                else:
                    await self._run_steps(plan)

    async def _wait_for_wakeup(self, timeout_s: float) -> bool:
        """True if woken (new work, an abort), False on timeout."""
        self._wakeup.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
        # cancellation that lands as the event is set, so stop() could wait on a
        # loop that never ends (a drained worker stayed listed, issue 11).
        try:
            async with asyncio.timeout(timeout_s):
                await self._wakeup.wait()
            return True
        except TimeoutError:
            return False

    async def _run_steps(self, first: StepPlan) -> None:
        """Run `first`; with overlapped scheduling, plan and send step N+1 while step
        N runs on the worker (planning, encoding and the RPC hide behind N's
        forward), as long as the planner can plan ahead. A step whose late masks
        wait on the applied step's tokens gets them before that step is streamed:
        with the next step planned ahead, or in a StepMasks call of their own."""
        in_flight = deque([await self._send(first)])
        try:
            while in_flight:
                await self._plan_ahead(in_flight)
                following = in_flight[1] if len(in_flight) > 1 else None
                updates = await self._complete(in_flight.popleft(), following)
                if updates is None:
                    break  # the worker failed or refused: the planner dropped the later steps
                if following is not None and following.late_masks is not None:
                    await self._plan_ahead(in_flight)
                    await self._deliver_late_masks(following)
                self._dispatch(updates)
        finally:
            await abandon(in_flight, self.client, self.grammars)

    async def _plan_ahead(self, in_flight: deque[SentStep]) -> None:
        """With one step in flight, plan and send the next (async scheduling)."""
        if self.options.async_scheduling and self.planner.can_plan_ahead and self.planner.has_work():
            if self.adapters is not None and self.adapters.wants_load(self.planner):
                return  # let the pipeline drain: an adapter is loaded only with no step in flight
            ahead = self.planner.schedule()
            if not ahead.is_empty:
                in_flight.append(await self._send(ahead, after=in_flight[-1]))

    async def _send(self, plan: StepPlan, after: SentStep | None = None) -> SentStep:
        """Send `plan` (planned ahead: right `after` that step, whose late masks it takes along)."""
        started = time.perf_counter()
        if self.grammars is not None and (rows := masks.inline_rows(plan)):
            plan.masks, failures = await masks.compute(self.grammars.filler, plan, rows, self._is_live)
            self._end_failed_grammars(failures, plan.step_id)
        if after is not None and after.late_masks is not None and not after.masks_delivered:
            plan.previous_masks = await after.late_masks  # computed while this plan was made
            after.masks_delivered = True
        sent = SentStep(plan, started, asyncio.create_task(self.client.step(plan)))
        sent.mask_ms = (time.perf_counter() - started) * 1e3 if plan.masks is not None else 0.0
        await asyncio.sleep(0)  # let the call encode and go out before the next step is planned
        return sent

    async def _start_late_masks(self, step: SentStep) -> None:
        """Start computing the masks of `step`'s rows planned ahead of their input, now
        that the step before it is applied (its tokens advanced the matchers). The
        filler's thread computes them while the loop streams the applied step and plans
        the next; nothing advances a matcher meanwhile: the next update() is that of
        `step`, whose result needs these masks."""
        step.late_masks = asyncio.create_task(self._late_masks(step))
        await asyncio.sleep(0)  # hand the rows to the filler's thread now

    async def _late_masks(self, step: SentStep) -> PlanMasks:
        assert self.grammars is not None, "a row waits for a mask, but this core has no grammar engine"
        plan = step.plan
        started = time.perf_counter()
        computed, failures = await masks.compute(self.grammars.filler, plan, plan.late_mask_rows, self._is_live)
        step.mask_ms += (time.perf_counter() - started) * 1e3
        self._end_failed_grammars(failures, plan.step_id)
        return computed

    async def _deliver_late_masks(self, step: SentStep) -> None:
        """Late masks no next step took along go in a StepMasks call of their own."""
        if step.late_masks is not None and not step.masks_delivered:
            step.masks_call = asyncio.create_task(self.client.step_masks(step.plan.step_id, await step.late_masks))
            step.masks_delivered = True

    def _is_live(self, request_id: str) -> bool:
        return request_id in self.planner.requests

    async def _complete(self, step: SentStep, following: SentStep | None = None) -> list[RequestUpdate] | None:
        """Apply a step's result: its updates, to stream (_dispatch); None if the steps after
        it are void. `following`: the step sent after it, whose late masks can be computed now."""
        plan = step.plan
        step_log = log.bind(step_id=plan.step_id, worker=self.info.address)
        try:
            result = await step.call
        except WorkerCallFailed as err:
            if err.transient:
                self._lose(f"step failed: {err}", step_id=plan.step_id)
            elif await self._restarted():  # a restarted worker refuses rows naming the adapter slots it lost
                self.planner.requeue_all(reset_prefix_cache=True)
                self._lose(f"restarted: step refused: {err}", step_id=plan.step_id)
            else:
                step_log.error("worker rejected step", code=err.reason, details=err.details)
                self._fail_plan(plan, err)
            return None
        finally:
            if step.masks_call is not None:  # it failed (or not) with the step; nothing more to learn
                await asyncio.gather(step.masks_call, return_exceptions=True)
        if result.instance_id != self.info.instance_id:
            # The worker restarted between two steps: its cache is empty, so this
            # result was computed over garbage. Forget it and recompute.
            step_log.warning("worker restarted", old=self.info.instance_id, new=result.instance_id)
            self.planner.requeue_all(reset_prefix_cache=True)
            self._lose("restarted between steps", step_id=plan.step_id)
            return None
        started = step.started
        for observe in self.hooks.on_step:  # before update(), while the step's requests are live
            observe(self, plan, result, started)
        spec = self.planner.drafter.counters if self.planner.drafter is not None else None
        accepted_before = spec.accepted_tokens if spec is not None else 0
        updates = self.planner.update(plan, result.samples)
        if self.step_budget is not None:
            self.step_budget.observe(plan.num_tokens, result.forward_ms)
        if following is not None and following.plan.late_mask_rows:
            await self._start_late_masks(following)  # the worker waits for them
        self._publish_kv_events()
        self.counters.steps_run += 1
        self.counters.tokens_computed += plan.num_tokens
        self.counters.offload_ms += result.offload_ms
        self.counters.onload_ms += result.onload_ms
        self.counters.last_step_ms = (time.perf_counter() - started) * 1e3
        if step_log.is_enabled_for(logging.DEBUG):  # its request id list costs a 256-sequence step ~0.1 ms
            step_log.debug(
                "step",
                seqs=len(plan.seqs),
                tokens=plan.num_tokens,
                forward_ms=round(result.forward_ms, 2),
                step_ms=round(self.counters.last_step_ms, 2),
                preempted=plan.preempted,
                planned_ahead=plan.previous_step_id is not None,
                masks=len(plan.masks.rows) if plan.masks is not None else 0,
                late_masks=len(plan.late_mask_rows),
                late_masks_call=step.masks_call is not None,
                mask_ms=round(step.mask_ms, 3),
                drafts=sum(s.num_drafts for s in plan.seqs),
                accepted=spec.accepted_tokens - accepted_before if spec is not None else 0,
                request_ids=[s.request_id for s in plan.seqs],
            )
        return updates

    def _publish_kv_events(self) -> None:
        """The prefix index's changes since the last batch, as one batch."""
        self.kv_events.publish(self.planner.kv.take_events())

    def _dispatch(self, updates: list[RequestUpdate]) -> None:
        stopped: set[str] = set()  # ended by a stop string in this step
        for update in updates:
            if update.request_id in stopped:
                continue  # the rest of an accepted run of drafts, after the stop string
            if update.error is not None:  # the planner has ended it
                self._fail_request(update.request_id, update.error)
                continue
            self.counters.generation_tokens += update.token_id is not None
            stream = self.streams.get(update.request_id)
            if stream is None:
                continue
            if stream.on_update(update):
                self.planner.finish(update.request_id, FinishReason.STOP)
                stopped.add(update.request_id)
            if stream.closed:
                del self.streams[update.request_id]
                if not update.forked:  # a fork parent's samples carry on under their own ids
                    self._finished(stream.request, stream.timing)
        if self.on_applied is not None:
            self.on_applied(self)

    def _finished(self, r: Request, timing: RequestTiming | None = None) -> None:
        self.counters.requests_finished += 1
        self.counters.finished_cached_prompt_tokens += r.num_cached_prompt_tokens
        log.info(
            "request finished",
            request_id=r.request_id,
            worker=self.info.address,
            prompt_tokens=r.num_prompt_tokens,
            cached_tokens=r.num_cached_prompt_tokens,
            output_tokens=r.num_output_tokens,
            finish_reason=str(r.finish_reason or FinishReason.STOP),
            preemptions=r.num_preemptions,
            **(timing.log_fields() if timing is not None else {}),
        )  # ttft_ms, e2e_ms, itl_ms_mean

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

    # ---- LoRA adapters ------------------------------------------------------
    async def _load_adapters(self) -> bool:
        """Load the adapters waiting requests need (nothing is in flight here); end the
        requests of an adapter that cannot be loaded. False if the worker was lost."""
        assert self.adapters is not None
        try:
            done = await self.adapters.load(self.planner, self.client)
        except WorkerCallFailed as err:
            self._lose(f"adapter load failed: {err}")
            return False
        self.counters.adapter_load_ms += sum(done.load_ms)
        for ref, error in done.refused:
            for request in waiting_for(self.planner, ref):
                self.planner.finish(request.request_id, FinishReason.ABORT)
                for request_id in [request.request_id] + [c.request_id for c in request.children]:
                    if request_id in self.streams:
                        self._fail_request(request_id, error)
        return True

    async def _restarted(self) -> bool:
        """With adapters, whether a worker that refused a step is a new instance."""
        if self.adapters is None:
            return False
        try:
            info = await self.client.info(timeout_s=_PROBE_TIMEOUT_S)
        except WorkerCallFailed:
            return False
        return info.instance_id != self.info.instance_id

    # ---- idle: health watch and audit -------------------------------------
    async def _idle(self) -> None:
        if await self._wait_for_wakeup(self.options.health_interval_s):
            return
        self._audit_if_changed()
        try:
            info = await self.client.info(timeout_s=_PROBE_TIMEOUT_S)
        except WorkerCallFailed as err:
            self._lose(f"health probe failed: {err}")
            return
        if info.instance_id != self.info.instance_id:
            self.planner.requeue_all(reset_prefix_cache=False)  # _accept_worker resets the prefix cache
            if not self._accept_worker(info):
                self._lose("came back with another pool")

    def _audit_if_changed(self) -> None:
        """Idle is when every block must be accounted for: prove it once per busy spell."""
        if self.counters.steps_run == self._audited_at_step:
            return
        self._audited_at_step = self.counters.steps_run
        self.audit()

    def audit(self) -> bool:
        """Prove every block of this worker's pool is accounted for (Planner.audit);
        a leak is counted and logged, not raised: the worker goes on serving."""
        try:
            self.planner.audit()
        except LeakError as exc:
            self.counters.audit_failures += 1
            log.error("engine audit failed", worker=self.info.address, error=str(exc))
            return False
        return True

    # ---- losing and regaining the worker ------------------------------------
    def _lose(self, reason: str, step_id: int | None = None) -> None:
        """Everything running goes back to the queue with its outputs; the prefix
        index is kept until we know whether the same worker instance comes back."""
        self.planner.requeue_all(reset_prefix_cache=False)
        self.healthy = False
        self._lost_at = time.monotonic()
        self.counters.worker_failures += 1
        log.warning(
            "worker lost", worker=self.info.address, reason=reason, step_id=step_id, requests=self.planner.num_waiting
        )

    async def _recover(self) -> None:
        """Until the worker answers again: move requests to a healthy worker if there
        is one; past worker_timeout_s, end those still here with UNAVAILABLE."""
        delay = _BACKOFF_FIRST_S
        while True:
            try:
                info = await self.client.info(timeout_s=_PROBE_TIMEOUT_S)
            except WorkerCallFailed:
                info = None
            if info is not None and self._accept_worker(info):
                return
            if self.planner.has_work() and self.handover is not None:
                self.handover(self)
            self._publish_kv_events()  # handing requests over resets the index
            if self.planner.has_work() and time.monotonic() - self._lost_at >= self.worker_timeout_s:
                failed = self.fail_all(
                    WorkerUnavailable(
                        f"worker {self.info.address} did not come back within "
                        f"{self.worker_timeout_s}s and no other worker could take over"
                    )
                )
                log.error("worker gone, requests failed", worker=self.info.address, failed=failed)
            await self._wait_for_wakeup(delay)
            delay = min(delay * 2, _BACKOFF_MAX_S)

    def _accept_worker(self, info: WorkerInfo) -> bool:
        """Trust the worker again if its pool matches ours; a new instance has an empty cache."""
        if problem := self.info.mismatch(info, same_pool=True):
            if info.instance_id != self._refused_instance:  # say it once per instance, not every retry
                self._refused_instance = info.instance_id
                log.error("worker came back with another model or pool; not using it", reason=problem)
            return False
        if info.instance_id != self.info.instance_id:
            dropped = self.planner.kv.reset_prefix_cache()
            if self.adapters is not None:
                self.adapters.slots.clear()
            self.counters.worker_restarts += 1
            log.warning(
                "worker restarted: prefix cache reset",
                worker=info.address,
                old=self.info.instance_id,
                new=info.instance_id,
                dropped_blocks=dropped,
            )
        log.info("worker back", worker=info.address, instance_id=info.instance_id, waiting=self.planner.num_waiting)
        self.info = info
        self.healthy = True
        self._wakeup.set()
        return True
