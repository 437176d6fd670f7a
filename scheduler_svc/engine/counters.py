"""A core's totals since start: summed by the Stats RPC (stats.py) and exported
by the observability layer, which read them without the core's loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TransferCounters:
    """Disaggregation's block moves into a worker (engine/disagg.py), prefill -> decode;
    `stayed` counts on the prefill worker."""

    handoffs: int = 0  # requests that moved here from a prefill worker
    stayed: int = 0  # requests no decode worker could take: decoded where they were prefilled
    transfers: int = 0  # FetchBlocks calls that succeeded
    failed: int = 0  # FetchBlocks calls that failed (the request recomputed its prompt)
    in_flight: int = 0  # FetchBlocks calls under way: the transfer queue's depth
    blocks: int = 0  # blocks moved
    blocks_skipped: int = 0  # blocks this worker's prefix index already held
    bytes: int = 0
    seconds: float = 0.0  # wall time of the successful transfers, summed

    def add(self, other: TransferCounters) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class CoreCounters:
    steps_run: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_moved_out: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tokens_computed: int = 0  # tokens the worker ran a forward over (recomputation included)
    worker_failures: int = 0
    worker_restarts: int = 0
    audit_failures: int = 0
    finished_cached_prompt_tokens: int = 0  # prompt tokens of finished requests found in the prefix cache at admission
    last_step_ms: float = 0.0
    offload_ms: float = 0.0  # the worker's time copying blocks down to its second KV tier (Step timings)
    onload_ms: float = 0.0  # and up
    adapter_load_ms: float = 0.0  # LoRA adapter loads onto this worker, all together
    kv_transfers: TransferCounters = field(default_factory=TransferCounters)
