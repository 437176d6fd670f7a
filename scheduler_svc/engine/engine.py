"""The scheduler's engine: the fleet of workers, one EngineCore each
(engine/fleet.py: connect, add, drain), the requests flowing through it
(engine/flow.py: submit, route, hand over), and what spans both: start-up and
the graceful shutdown."""

from __future__ import annotations

import asyncio
import time

import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.fleet import Fleet
from scheduler_svc.engine.flow import RequestFlow
from scheduler_svc.engine.router import Router, make_router
from scheduler_svc.engine.timing import EngineHooks
from scheduler_svc.text.tokenizer import ModelTokenizer
from svc_common.targets import Resolver, resolve_dns

log = structlog.get_logger(__name__)


class Engine:
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.requests = RequestFlow(fleet, fleet.router)
        fleet.on_lost_worker(self.requests.handover)
        self.tokenizer = fleet.tokenizer
        self.max_model_len = fleet.max_model_len
        self.grammars = fleet.grammars  # structured outputs: compiled at admission (api/serving.py)

    @classmethod
    async def connect(
        cls,
        config: SchedulerConfig,
        tokenizer: ModelTokenizer,
        hooks: EngineHooks[EngineCore] = EngineHooks(),
        resolver: Resolver = resolve_dns,
        router: Router | None = None,
    ) -> Engine:
        """Connect to the workers (Fleet.connect) and start a step loop for each."""
        if router is None:
            router = make_router(config.routing, affinity_ttl_s=config.routing_affinity_ttl_s)
        engine = cls(await Fleet.connect(config, tokenizer, router, hooks, resolver))
        for core in engine.cores:
            core.start()
        return engine

    @property
    def cores(self) -> list[EngineCore]:
        return self.fleet.cores

    @property
    def accepting(self) -> bool:
        """New requests can be served: not shutting down and some worker is serving
        (healthy and not being drained)."""
        return not self.requests.closed and bool(self.fleet.serving_cores())

    # ---- shutdown -----------------------------------------------------------
    def start_draining(self) -> None:
        """Refuse new requests (UNAVAILABLE) and new workers; accepted requests run to the end."""
        self.requests.closed = self.fleet.closed = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until every client stream has ended or timeout_s passed; True if idle."""
        deadline = time.monotonic() + timeout_s
        while self.requests.num_live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.requests.num_live

    def fail_all(self, error: Exception) -> int:
        """End every live request with `error`; returns how many streams."""
        return sum(core.fail_all(error) for core in self.cores)

    def log_audit(self) -> bool:
        """Audit every pool and log the outcome (at shutdown, when all must be free)."""
        clean = not [core for core in self.cores if not core.audit()]  # every core audited, each logs its own
        if clean:
            log.info(
                "engine audit clean",
                blocks_used=sum(c.planner.kv.pool.num_used_blocks for c in self.cores),
                audit_failures=sum(c.counters.audit_failures for c in self.cores),
                worker_failures=sum(c.counters.worker_failures for c in self.cores),
                requests_failed=sum(c.counters.requests_failed for c in self.cores),
            )
        return clean

    async def stop(self) -> None:
        await self.requests.handoff.close()
        await self.fleet.close()
