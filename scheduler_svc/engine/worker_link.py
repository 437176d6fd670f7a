"""The engine core's link to its worker: losing it and regaining it, and the idle
watch (health probes, the block audit).

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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import structlog

from scheduler_svc.engine.adapter_loader import AdapterLoader
from scheduler_svc.engine.core_requests import CoreRequests
from scheduler_svc.engine.errors import WorkerCallFailed, WorkerUnavailable
from scheduler_svc.engine.kv_events import WorkerKvEvents
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.kv.block_manager import LeakError

log = structlog.get_logger(__name__)

BACKOFF_FIRST_S, _BACKOFF_MAX_S = 0.05, 1.0
_PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class CoreOptions:
    worker_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    async_scheduling: bool = True  # plan and send step N+1 while step N runs


class WorkerLink(CoreRequests):
    client: WorkerClient
    options: CoreOptions
    # Called with the core that lost its worker (core.py's Handover): moves its live
    # requests to another worker and returns True, or returns False if none can take them.
    handover: Callable[[Self], bool] | None
    adapters: AdapterLoader | None
    kv_events: WorkerKvEvents
    _lost_at: float
    _refused_instance: str
    _audited_at_step: int

    @property
    def worker_timeout_s(self) -> float:
        return self.options.worker_timeout_s

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

    def _publish_kv_events(self) -> None:
        """The prefix index's changes since the last batch, as one batch."""
        self.kv_events.publish(self.planner.kv.take_events())

    async def _restarted(self) -> bool:
        """With adapters, whether a worker that refused a step is a new instance."""
        if self.adapters is None:
            return False
        try:
            info = await self.client.info(timeout_s=_PROBE_TIMEOUT_S)
        except WorkerCallFailed:
            return False
        return info.instance_id != self.info.instance_id

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

    async def _recover(self: Self) -> None:
        """Until the worker answers again: move requests to a healthy worker if there
        is one; past worker_timeout_s, end those still here with UNAVAILABLE."""
        delay = BACKOFF_FIRST_S
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
