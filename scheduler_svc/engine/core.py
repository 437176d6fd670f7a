"""Drives one worker: plan a step, run it on the worker, apply the result,
stream the deltas. Everything runs on the asyncio loop, so the planner is only
ever touched from one thread; the worker call is the only await in a step.

The requests and their client streams are CoreRequests' (core_requests.py);
losing and regaining the worker, and the idle watch, are WorkerLink's
(worker_link.py): EngineCore is built on both.

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

import structlog

from scheduler_svc.engine import masks
from scheduler_svc.engine.adapter_loader import AdapterLoader, waiting_for
from scheduler_svc.engine.counters import CoreCounters
from scheduler_svc.engine.errors import SchedulerBug, WorkerCallFailed
from scheduler_svc.engine.kv_events import WorkerKvEvents
from scheduler_svc.engine.sent import SentStep, abandon
from scheduler_svc.engine.step_budget import SpeedBudget
from scheduler_svc.engine.step_stream import StepStream
from scheduler_svc.engine.streams import RequestStream
from scheduler_svc.engine.timing import EngineHooks, RequestTiming
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.engine.worker_link import BACKOFF_FIRST_S, WorkerLink
from scheduler_svc.engine.worker_link import CoreOptions as CoreOptions  # where fleet.py takes it from
from scheduler_svc.planning.plan import PlanMasks, RequestUpdate, StepPlan
from scheduler_svc.planning.planner import Planner
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.structured.grammars import Grammars
from scheduler_svc.text.tokenizer import ModelTokenizer

log = structlog.get_logger(__name__)

_STOP_RETRY_S = 1.0


# Called by a core that lost its worker, with itself: moves its live requests to
# another worker and returns True, or returns False if no worker can take them.
Handover = Callable[["EngineCore"], bool]
# Called by a core with itself after it streamed a step's tokens (disaggregation: a
# prefill worker's requests whose first token is out leave for a decode worker).
Applied = Callable[["EngineCore"], None]


class EngineCore(WorkerLink):
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
        self._stream: StepStream | None = None  # the run of overlapped steps' (_run_steps)
        self._task: asyncio.Task[None] | None = None

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
                await asyncio.sleep(BACKOFF_FIRST_S)

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

    async def _run_steps(self, first: StepPlan) -> None:
        """Run `first`; with overlapped scheduling, plan and send step N+1 while step
        N runs on the worker (planning, encoding and the RPC hide behind N's
        forward), as long as the planner can plan ahead. A step whose late masks
        wait on the applied step's tokens gets them before that step is streamed:
        with the next step planned ahead, or in a StepMasks call of their own."""
        stream = self._stream = StepStream(self.client)
        in_flight: deque[SentStep] = deque()
        try:
            in_flight.append(await self._send(first))
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
            await stream.close()

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
        assert self._stream is not None, "steps go out within a run of steps (_run_steps)"
        sent = SentStep(plan, started, asyncio.create_task(self._stream.step(plan)))
        sent.mask_ms = (time.perf_counter() - started) * 1e3 if plan.masks is not None else 0.0
        try:
            await asyncio.sleep(0)  # let the step encode and go out before the next is planned
        except asyncio.CancelledError:  # the run is stopping before it holds this step: no one will wait for it
            sent.call.cancel()
            raise
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
