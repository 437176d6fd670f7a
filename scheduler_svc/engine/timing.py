"""Request timing and the engine's observation hooks.

The engine only records: token timestamps per request (`RequestTiming`) and a
callback per step. What is done with them (histograms, rates, Prometheus) is
the observability layer's business; it plugs in through `EngineHooks`, so the
engine never imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from scheduler_svc.engine.worker_client import StepResult
    from scheduler_svc.planning.plan import StepPlan

Clock = Callable[[], float]


class LatencyObserver(Protocol):
    """Receives a request's latencies as they happen."""

    def observe_ttft(self, seconds: float, now: float) -> None: ...

    def observe_itl(self, seconds: float, now: float) -> None: ...

    def observe_finish(self, reason: str, e2e_s: float, now: float) -> None: ...


class NoLatencyObserver:
    def observe_ttft(self, seconds: float, now: float) -> None:
        pass

    def observe_itl(self, seconds: float, now: float) -> None:
        pass

    def observe_finish(self, reason: str, e2e_s: float, now: float) -> None:
        pass


Core = TypeVar("Core")  # the engine core (core.py): its type lives above this module, which it imports


@dataclass(frozen=True)
class EngineHooks(Generic[Core]):
    latency: LatencyObserver = NoLatencyObserver()
    # Called once per step after the worker answered and before planner.update(),
    # so the step's requests are still live: (core, plan, result, perf_counter at the call).
    on_step: tuple[Callable[[Core, StepPlan, StepResult, float], None], ...] = ()
    clock: Clock = time.monotonic


class RequestTiming:
    """Token timestamps of one request stream (a sample of an n > 1 request is
    its own stream): TTFT, inter-token gaps, end-to-end time, passed to
    `observer` as they happen. `arrival` is the request's arrival (monotonic)."""

    __slots__ = ("arrival", "first_token", "last_token", "num_tokens", "ended", "observer", "clock")

    def __init__(
        self, arrival: float | None = None, observer: LatencyObserver | None = None, clock: Clock | None = None
    ):
        self.observer: LatencyObserver = observer if observer is not None else NoLatencyObserver()
        self.clock: Clock = clock or getattr(observer, "clock", None) or time.monotonic
        self.arrival = arrival if arrival is not None else self.clock()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.ended: float | None = None

    def on_tokens(self, count: int) -> None:
        if count <= 0 or self.ended is not None:
            return
        now = self.clock()
        if self.first_token is None or self.last_token is None:
            self.first_token = now
            self.observer.observe_ttft(now - self.arrival, now)
        else:
            # An event carrying k tokens spreads its gap over them.
            gap = (now - self.last_token) / count
            for _ in range(count):
                self.observer.observe_itl(gap, now)
        self.last_token = now
        self.num_tokens += count

    def finish(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = self.clock()
        self.observer.observe_finish(reason, self.ended - self.arrival, self.ended)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_s(self) -> float | None:
        return None if self.ended is None else self.ended - self.arrival

    def log_fields(self) -> dict[str, Any]:
        """ttft_ms, e2e_ms and the mean inter-token gap for a request's finish line."""
        out: dict[str, Any] = {"ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 2)}
        end = self.ended if self.ended is not None else self.clock()
        out["e2e_ms"] = round((end - self.arrival) * 1e3, 2)
        if self.num_tokens > 1 and self.first_token is not None and self.last_token is not None:
            out["itl_ms_mean"] = round((self.last_token - self.first_token) / (self.num_tokens - 1) * 1e3, 2)
        return out
