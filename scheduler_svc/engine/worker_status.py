"""One worker as the admin service lists it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler_svc.engine.router import WorkerState

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    address: str
    state: WorkerState
    running: int = 0
    waiting: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from this worker's prefix cache
    prompt_tokens: int = 0  # prompt tokens of requests admitted on this worker
    requests_routed: int = 0
    requests_finished: int = 0
    model: str = ""
    device: str = ""
    kv_dtype: str = ""

    @classmethod
    def from_core(
        cls, core: EngineCore, state: WorkerState, prefix_hit_tokens: int = 0, requests_routed: int = 0
    ) -> WorkerStatus:
        usage = core.planner.kv.usage()
        return cls(
            address=core.info.address,
            state=state,
            running=core.planner.num_running,
            waiting=core.planner.num_waiting,
            blocks_total=usage.num_blocks,
            blocks_used=usage.used_blocks,
            blocks_free=usage.free_blocks,
            prefix_hit_tokens=prefix_hit_tokens,
            prompt_tokens=core.counters.prompt_tokens,
            requests_routed=requests_routed,
            requests_finished=core.counters.requests_finished,
            model=core.info.model_name,
            device=core.info.device,
            kv_dtype=core.info.kv_dtype,
        )
