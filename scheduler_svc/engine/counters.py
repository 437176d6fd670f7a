"""A core's totals since start: summed by the Stats RPC (stats.py) and exported
by the observability layer, which read them without the core's loop."""

from __future__ import annotations

from dataclasses import dataclass


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
