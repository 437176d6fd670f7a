"""Workers that join and leave: the dns:/// entries of --workers.

Every A/AAAA record of a `dns:///NAME:PORT` entry is a worker (a Kubernetes
headless Service has one per ready pod). `WorkerDiscovery` resolves the names
again every `--worker-discovery-interval-s` and moves the fleet towards the
answer through the same calls as admin.v1 (api/admin.py):

* a new address joins with `Fleet.add_worker` (Info, the compatibility checks,
  then routable: the prefix router sees a cold worker, so misses go there first);
  one that does not answer within an interval is tried again at the next;
* an address it added that is no longer listed is drained with
  `Fleet.drain_worker`: it gets nothing new, finishes its requests (or hands
  them over if it is dead), then is forgotten. The last worker is drained too:
  DNS is the truth about the fleet.

Fixed HOST:PORT entries and workers added through admin.v1 are never drained
by discovery. A worker drained through admin.v1 while its address is still in
DNS joins again at the next resolution after its removal. A round in which a
name fails to resolve drains nobody: an outage is not every worker leaving.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.errors import StartupError, WorkerAdminError
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.engine.worker_status import WorkerStatus
from svc_common.targets import Resolver, Target, resolve_dns, resolve_targets

log = structlog.get_logger(__name__)

# (address, TLS server name, timeout_s) -> a connected client and its Info; raises StartupError.
OpenWorker = Callable[[str, str, float], Awaitable[tuple[WorkerClient, WorkerInfo]]]


class Fleet(Protocol):
    """The fleet as discovery moves it (fleet.Fleet, which imports this module for
    first_workers): the same calls as admin.v1."""

    config: SchedulerConfig
    cores: list[EngineCore]

    def list_workers(self) -> list[WorkerStatus]: ...

    async def add_worker(
        self, address: str, tls_server_name: str = "", timeout_s: float | None = None, discovered: bool = False
    ) -> WorkerStatus: ...

    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus: ...


async def first_workers(
    targets: list[Target], resolver: Resolver, open_worker: OpenWorker, timeout_s: float, interval_s: float
) -> list[tuple[WorkerClient, WorkerInfo]]:
    """Start-up with dns:/// workers only: resolve every interval until some of the
    workers answer Info, for up to timeout_s (workers load their weights for minutes
    and only then appear in a headless Service). Those that do not answer yet are
    left to WorkerDiscovery. Raises StartupError naming --workers."""
    deadline = time.monotonic() + timeout_s
    while True:
        peers = (await resolve_targets(targets, resolver)).peers
        attempt_s = max(min(interval_s, deadline - time.monotonic()), 0.1)
        opened = await asyncio.gather(
            *(open_worker(address, t.host, attempt_s) for address, t in peers.items()), return_exceptions=True
        )
        for result in opened:
            if isinstance(result, BaseException) and not isinstance(result, StartupError):
                raise result
        workers = [r for r in opened if not isinstance(r, BaseException)]
        if workers:
            return workers
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            found = ", ".join(peers) or "no address"
            raise StartupError(
                f"--workers: no worker of {', '.join(map(str, targets))} answered within {timeout_s}s "
                f"(resolved to {found})"
            )
        if not peers:  # nothing was tried: wait for the records to change
            await asyncio.sleep(min(interval_s, left_s))


class WorkerDiscovery:
    def __init__(
        self, fleet: Fleet, targets: list[Target], interval_s: float, resolver: Resolver = resolve_dns
    ) -> None:
        self.fleet = fleet
        self.targets = [t for t in targets if t.dns]
        self.interval_s = interval_s
        self._resolver = resolver
        fixed = {t.address for t in targets if not t.dns}
        # Workers discovery added (and may drain): the start-up ones not listed as fixed.
        self.managed = {c.info.address for c in fleet.cores} - fixed
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.targets:
            self._task = asyncio.create_task(self._run(), name="worker-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                await self.reconcile()
            except Exception:  # a bug must not end discovery: the next round tries again
                log.exception("worker discovery round failed")
            await asyncio.sleep(self.interval_s)

    async def reconcile(self) -> None:
        """One round: resolve, add the new addresses (each given up to one interval to
        answer), drain the ones discovery added that are no longer listed."""
        resolved = await resolve_targets(self.targets, self._resolver)
        states = {w.address: w.state for w in self.fleet.list_workers()}
        joining = [(a, t) for a, t in resolved.peers.items() if a not in states]
        leaving = sorted(
            a
            for a in self.managed
            if a not in resolved.peers and states.get(a) not in (None, WorkerState.DRAINING) and not resolved.failed
        )
        await asyncio.gather(*(self._join(address, target) for address, target in joining))
        for address in leaving:
            await self._leave(address)
        listed = {w.address for w in self.fleet.list_workers()}
        self.managed &= listed  # drained and removed: forgotten

    async def _join(self, address: str, target: Target) -> None:
        try:
            timeout_s = min(self.interval_s, self.fleet.config.connect_timeout_s)
            await self.fleet.add_worker(address, tls_server_name=target.host, timeout_s=timeout_s, discovered=True)
        except WorkerAdminError as exc:
            log.warning("discovered worker not added; trying again next round", worker=address, error=str(exc))
            return
        self.managed.add(address)
        log.info("discovered worker joined", worker=address, target=str(target))

    async def _leave(self, address: str) -> None:
        try:
            await self.fleet.drain_worker(address, allow_last=True)
        except WorkerAdminError as exc:  # removed meanwhile
            log.info("worker left DNS and is already gone", worker=address, error=str(exc))
            return
        log.info("worker left DNS: draining", worker=address)
