"""Per-worker step accounting and the small windows behind the Stats RPC's
rates and quantiles. Plain Python: nothing here knows Prometheus."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore
    from scheduler_svc.planning.plan import StepPlan
    from scheduler_svc.request import Request

RATE_WINDOW_S = 10.0  # Stats' per-second figures: over the last 10 s
RECENT_WINDOW_S = 60.0  # Stats' p50/p95 figures: observations of the last 60 s...
RECENT_MAX = 2048  # ...at most this many
_SAMPLE_EVERY_S = 0.1  # step-hook rate samples at most this often per worker


class RateWindow:
    """Per-second rates of monotonic counters over the last `window_s` seconds.

    Samples are (time, values). The rate at `now` is (value now - value at
    now - window_s) / window_s, where the value at a past time is the newest
    sample at or before it (counters only change when sampled, at step
    granularity, so this is a step function, not an interpolation). Before a
    full window has passed the denominator is the time since the first sample.
    """

    def __init__(self, window_s: float = RATE_WINDOW_S, max_samples: int = 1024):
        self.window_s = window_s
        self.samples: deque[tuple[float, tuple[float, ...]]] = deque(maxlen=max_samples)

    def observe(self, now: float, values: tuple[float, ...]) -> None:
        if self.samples and now < self.samples[-1][0]:
            return  # the clock never goes back; ignore out-of-order samples
        self.samples.append((now, tuple(values)))
        cutoff = now - self.window_s
        # Keep the newest sample at or before the cutoff: it is the window's baseline.
        while len(self.samples) >= 2 and self.samples[1][0] <= cutoff:
            self.samples.popleft()

    def rates(self, now: float, values: tuple[float, ...]) -> tuple[float, ...]:
        self.observe(now, values)
        first_t, first_v = self.samples[0]
        cutoff = now - self.window_s
        if first_t <= cutoff:
            span = self.window_s
        else:
            span = now - first_t
        if span <= 0:
            return tuple(0.0 for _ in values)
        return tuple(max(0.0, (v - b) / span) for v, b in zip(values, first_v))


class RecentValues:
    """Observations of the last `window_s` seconds (at most `max_len`), for quantiles."""

    def __init__(self, window_s: float = RECENT_WINDOW_S, max_len: int = RECENT_MAX):
        self.window_s = window_s
        self.values: deque[tuple[float, float]] = deque(maxlen=max_len)

    def add(self, value: float, now: float) -> None:
        self.values.append((now, value))

    def current(self, now: float) -> list[float]:
        cutoff = now - self.window_s
        while self.values and self.values[0][0] < cutoff:
            self.values.popleft()
        return [v for _, v in self.values]

    def quantile(self, q: float, now: float) -> float:
        """Nearest-rank quantile of the recent values; 0 with none."""
        values = sorted(self.current(now))
        if not values:
            return 0.0
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]

    def mean(self, now: float) -> float:
        values = self.current(now)
        return sum(values) / len(values) if values else 0.0


@dataclass
class CoreMetrics:
    """What one engine core adds to its planner's and pool's own counters."""

    worker: str
    prefill_tokens: int = 0
    decode_tokens: int = 0
    # vLLM's prompt_tokens: a request's whole prompt (cached part included),
    # counted when it samples its first token.
    first_token_prompt_tokens: int = 0
    rates: RateWindow = field(default_factory=RateWindow)
    _sampled_at: float = -math.inf

    def sample(self, core: EngineCore, now: float) -> None:
        """Feed the rate window, at most every _SAMPLE_EVERY_S (the step hook calls it)."""
        if now - self._sampled_at < _SAMPLE_EVERY_S:
            return
        self._sampled_at = now
        self.rates.observe(now, _rate_values(core, self))

    def rates_now(self, core: EngineCore, now: float) -> tuple[float, ...]:
        """Sample now and return the per-second rates (the Stats RPC)."""
        self._sampled_at = now
        return self.rates.rates(now, _rate_values(core, self))


def _rate_values(core: EngineCore, cm: CoreMetrics) -> tuple[float, ...]:
    """(blocks allocated, blocks freed, tokens computed, tokens generated): the counters Stats turns into rates."""
    pool = core.planner.kv.pool  # a BlockPool, or a contiguous worker's SlotPool
    return (
        getattr(pool, "blocks_allocated", 0),
        getattr(pool, "blocks_freed", 0),
        cm.prefill_tokens + cm.decode_tokens,
        core.counters.generation_tokens,
    )


def core_metrics(core: EngineCore) -> CoreMetrics:
    """The core's CoreMetrics, created on first use (kept in the slot the core
    leaves to its observers, so it lives and dies with the core)."""
    cm = getattr(core, "metrics", None)
    if not isinstance(cm, CoreMetrics):
        cm = core.metrics = CoreMetrics(core.info.address)
    return cm


def split_step_tokens(plan: StepPlan, lookup: Callable[[str], Request | None]) -> tuple[int, int, int]:
    """(prefill tokens, decode tokens, prefill chunks) of a step. A decode is one
    token at a position past the prompt; everything else (prompt chunks,
    recomputation after a preemption, a fork sample's last prompt token) is
    prefill. `lookup(request_id)` gives the live Request, or None."""
    prefill = decode = chunks = 0
    for seq in plan.seqs:
        n = len(seq.token_ids)
        request = lookup(seq.request_id)
        is_decode = n == 1 and (request is None or seq.start_pos >= request.num_prompt_tokens)
        if is_decode:
            decode += 1
        else:
            prefill += n
            chunks += 1
    return prefill, decode, chunks


def first_token_prompt_tokens(plan: StepPlan, lookup: Callable[[str], Request | None]) -> int:
    """Prompt tokens of the requests that sample their first token in this step
    (each sample of an n > 1 request is one; a fork parent samples nothing)."""
    total = 0
    for seq in plan.seqs:
        request = lookup(seq.request_id)
        if seq.sample and request is not None and not request.prefill_only and request.num_output_tokens == 0:
            total += request.num_prompt_tokens
    return total
