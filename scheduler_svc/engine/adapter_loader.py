"""Loading LoRA adapters onto one worker before the steps that need them. The core
calls `load` with no step in flight (never mid-step: a slot's weights change only
between steps); with requests waiting for an adapter it can place, it stops planning
ahead so the pipeline drains (`wants_load`). An adapter the registry no longer has, or
that the worker refuses, ends the requests waiting for it with the reason."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog

from scheduler_svc.engine.errors import WorkerCallFailed
from scheduler_svc.engine.worker_client import WorkerClient
from scheduler_svc.lora.errors import LoraRejected
from scheduler_svc.lora.registry import LoraRegistry
from scheduler_svc.lora.slots import AdapterSlots, Placement
from scheduler_svc.planning.planner import Planner
from scheduler_svc.request import LoraRef, Request

log = structlog.get_logger(__name__)

_LOAD_TIMEOUT_S = 60.0


@dataclass(slots=True)
class LoadRound:
    """What one `load` did: adapters whose waiting requests must end (and why)."""

    refused: list[tuple[LoraRef, LoraRejected]] = field(default_factory=list)
    load_ms: list[float] = field(default_factory=list)


class AdapterLoader:
    def __init__(self, registry: LoraRegistry, slots: AdapterSlots) -> None:
        self.registry = registry
        self.slots = slots

    def wanted(self, planner: Planner) -> list[LoraRef]:
        """Adapters waiting requests name that this worker does not hold, in queue order."""
        seen: dict[LoraRef, None] = {}
        for request in planner.waiting:
            if request.lora is not None and not self.slots.holds(request.lora):
                seen.setdefault(request.lora)
        return list(seen)

    def wants_load(self, planner: Planner) -> bool:
        """Some waiting request's adapter can get a slot now (drain the pipeline to load it)."""
        return bool(self.wanted(planner)) and self._place(planner) is not None

    def _place(self, planner: Planner) -> Placement | None:
        return self.slots.place(_adapters(planner.running), _adapters(planner.waiting))

    async def load(self, planner: Planner, client: WorkerClient) -> LoadRound:
        """Load what waiting requests need, oldest first, while slots can be had. Raises
        WorkerCallFailed when the worker is lost (transient); a refusal is in the round."""
        result = LoadRound()
        wanted = self.wanted(planner)
        if not wanted:
            self.slots.reopen()
        for ref in wanted:
            placement = self._place(planner)
            if placement is None:
                break  # every slot in use: the least recently used adapter is closing
            try:
                files = self.registry.files(ref)
            except LoraRejected as exc:
                result.refused.append((ref, exc))
                continue
            started = time.perf_counter()
            try:
                await client.load_adapter(placement.slot, ref.name, files.files, _LOAD_TIMEOUT_S)
            except WorkerCallFailed as err:
                if err.transient:
                    raise
                result.refused.append((ref, LoraRejected("lora_adapter", f"adapter {ref.name!r}: {err.details}")))
                continue
            self.slots.loaded(ref, placement)
            elapsed_ms = (time.perf_counter() - started) * 1e3
            result.load_ms.append(elapsed_ms)
            log.info(
                "lora adapter loaded",
                worker=client.address,
                name=ref.name,
                slot=placement.slot,
                evicted=placement.evicted.name if placement.evicted else None,
                load_ms=round(elapsed_ms, 2),
                bytes=files.num_bytes,
            )
        return result


def _adapters(requests: Iterable[Request]) -> set[LoraRef]:
    return {r.lora for r in requests if r.lora is not None}


def waiting_for(planner: Planner, ref: LoraRef) -> list[Request]:
    return [r for r in planner.waiting if r.lora == ref]
