"""A CPU worker's step budget, sized from its measured speed (issue 35: a 3,800-token
prompt was one 36 s step on a 2-core CPU, and every stream stalled behind it).

On an accelerator --max-num-batched-tokens and --chunk-size are used as given. On a
CPU worker a step's time grows with its tokens at a speed no constant fits, so the
budget follows the worker: each step with a prefill in it gives its forward time per
token; the median of the last few (a cold first step or a burst of load on a shared
machine is one sample, not the estimate; attention makes late chunks of a long prompt
dearer per token, which the window follows within a few steps) sizes it: the step
budget becomes what fits --step-target-ms, within 64..--max-num-batched-tokens.
One request's prefill chunk gets at most half of it (vLLM's long-prefill threshold,
here --chunk-size's ceiling): a short request that arrives meanwhile shares the next
step instead of waiting for the long prompt to finish."""

from __future__ import annotations

import statistics
from collections import deque

import structlog

from scheduler_svc.planning.config import PlannerConfig

log = structlog.get_logger(__name__)

MIN_BUDGET = 64  # below this a step's fixed cost dominates (and decodes of a big batch would starve)
INITIAL_BUDGET = 256  # before the first measurement: ~1 s of prefill on a slow 2-core CPU
MIN_SAMPLE_TOKENS = 32  # a step with fewer tokens (decodes) says little about prefill's cost per token
WINDOW = 8  # recent prefill steps whose median cost per token is the estimate


class SpeedBudget:
    def __init__(self, config: PlannerConfig, target_ms: float, worker: str) -> None:
        """Tunes `config` (a planner's, in place) below its flags' values, which stay the ceilings."""
        self.config = config
        self.target_ms = target_ms
        self.worker = worker
        self.max_budget = config.max_num_batched_tokens
        self.max_chunk = config.chunk_size
        self._costs: deque[float] = deque(maxlen=WINDOW)  # ms per token of recent prefill steps
        self._apply(INITIAL_BUDGET)

    @property
    def ms_per_token(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def observe(self, num_tokens: int, forward_ms: float) -> None:
        """A finished step: its tokens and the worker's forward time."""
        if num_tokens < MIN_SAMPLE_TOKENS or forward_ms <= 0:
            return
        cost = forward_ms / num_tokens
        self._costs.append(cost)
        self._apply(int(self.target_ms / statistics.median(self._costs)))
        if len(self._costs) == 1:
            log.info(
                "step budget sized from the worker's speed",
                worker=self.worker,
                ms_per_token=round(cost, 3),
                target_ms=self.target_ms,
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                chunk_size=self.config.chunk_size,
            )

    def _apply(self, budget: int) -> None:
        budget = max(MIN_BUDGET, min(self.max_budget, budget))
        block = self.config.block_size
        half = max(block, (budget // 2) // block * block)
        self.config.max_num_batched_tokens = budget
        self.config.chunk_size = min(self.max_chunk, half)


def step_budget(config: PlannerConfig, device: str, target_ms: float, worker: str) -> SpeedBudget | None:
    """The tuner of a worker on `device` (its Info), or None: an accelerator, or tuning off (target 0)."""
    if target_ms <= 0 or not device.startswith("cpu"):
        return None
    return SpeedBudget(config, target_ms, worker)
