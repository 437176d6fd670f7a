"""Scheduler metrics fed by hooks: time to first token, inter-token latency and
end-to-end time per request (the engine's RequestTiming reports them through
the LatencyObserver protocol), and per step: step time, tokens per step,
per-chunk prefill time and the worker's forward time (`observe_step`, an engine
step hook). `engine_hooks()` plugs them into an engine. State that is read at
scrape time (pool gauges, counters) is collector.py's.

Per-worker series carry a `worker` label (the worker's address); request-level
histograms are engine-wide (a request can move between workers). The same
request latencies also feed vLLM's histograms (names.VLLM_METRIC_NAMES, vLLM's
buckets, a `model_name` label) once an engine is registered.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.registry import Collector

from scheduler_svc.engine.timing import Clock, EngineHooks
from scheduler_svc.observability.accounting import (
    RecentValues,
    core_metrics,
    first_token_prompt_tokens,
    split_step_tokens,
)
from scheduler_svc.observability.collector import EngineCollector
from scheduler_svc.observability.names import METRIC_NAMES, VLLM_METRIC_NAMES

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore
    from scheduler_svc.engine.engine import Engine
    from scheduler_svc.engine.worker_client import StepResult
    from scheduler_svc.planning.plan import StepPlan

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards and SLO queries apply as they are.
_VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_VLLM_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_VLLM_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_LATENCY_BUCKETS = tuple(b for b in _VLLM_TTFT_BUCKETS if b <= 80.0)  # time to first token
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384


def _histogram(registry: CollectorRegistry, name: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
    """A histogram documented by names.py (ours or vLLM's)."""
    documentation = METRIC_NAMES[name] if name in METRIC_NAMES else VLLM_METRIC_NAMES[name]
    return Histogram(name, documentation, labels, buckets=buckets, registry=registry)


class SchedulerMetrics:
    """Histograms and counters fed by hooks, in their own registry (one per
    scheduler process: `METRICS`), plus recent windows for the Stats RPC."""

    def __init__(self, registry: CollectorRegistry | None = None, clock: Clock = time.monotonic):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        r = self.registry
        self.ttft = _histogram(r, "pagedserve_time_to_first_token_seconds", _LATENCY_BUCKETS)
        self.itl = _histogram(r, "pagedserve_inter_token_latency_seconds", _ITL_BUCKETS)
        self.e2e = _histogram(r, "pagedserve_e2e_request_latency_seconds", _E2E_BUCKETS)
        self.finished = Counter(
            "pagedserve_requests_finished",
            METRIC_NAMES["pagedserve_requests_finished_total"],
            ["finish_reason"],
            registry=r,
        )
        self.step = _histogram(r, "pagedserve_step_duration_seconds", _STEP_BUCKETS, "worker")
        self.step_tokens = _histogram(r, "pagedserve_step_tokens", _TOKEN_BUCKETS, "worker")
        self.prefill_chunk = _histogram(r, "pagedserve_prefill_chunk_duration_seconds", _STEP_BUCKETS, "worker")
        self.forward = _histogram(r, "pagedserve_worker_forward_duration_seconds", _STEP_BUCKETS, "worker")
        self.vllm_histograms = {
            name: _histogram(r, name, buckets, "model_name")
            for name, buckets in (
                ("vllm:time_to_first_token_seconds", _VLLM_TTFT_BUCKETS),
                ("vllm:inter_token_latency_seconds", _VLLM_ITL_BUCKETS),
                ("vllm:e2e_request_latency_seconds", _VLLM_E2E_BUCKETS),
            )
        }
        # The registered engine's model: its children of vllm_histograms (none before).
        self._vllm: dict[str, Histogram] = {}
        self.recent = {
            name: RecentValues() for name in ("ttft", "itl", "e2e", "step", "forward", "step_tokens", "prefill_chunk")
        }
        self._collector: Collector | None = None

    # request level (RequestTiming calls these)
    def observe_ttft(self, seconds: float, now: float) -> None:
        self.ttft.observe(seconds)
        self._observe_vllm("vllm:time_to_first_token_seconds", seconds)
        self.recent["ttft"].add(seconds, now)

    def observe_itl(self, seconds: float, now: float) -> None:
        self.itl.observe(seconds)
        self._observe_vllm("vllm:inter_token_latency_seconds", seconds)
        self.recent["itl"].add(seconds, now)

    def observe_finish(self, reason: str, e2e_s: float, now: float) -> None:
        self.finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):  # an abort's time is the client's, an error's the failure's
            self.e2e.observe(e2e_s)
            self._observe_vllm("vllm:e2e_request_latency_seconds", e2e_s)
            self.recent["e2e"].add(e2e_s, now)

    def _observe_vllm(self, name: str, seconds: float) -> None:
        if child := self._vllm.get(name):
            child.observe(seconds)

    # step level (observe_step calls this)
    def observe_step_timing(
        self, worker: str, step_s: float, forward_s: float, tokens: int, prefill_chunks: int, now: float
    ) -> None:
        self.step.labels(worker=worker).observe(step_s)
        self.step_tokens.labels(worker=worker).observe(tokens)
        self.forward.labels(worker=worker).observe(forward_s)
        for _ in range(prefill_chunks):
            self.prefill_chunk.labels(worker=worker).observe(step_s)
        self.recent["step"].add(step_s, now)
        self.recent["step_tokens"].add(tokens, now)
        self.recent["forward"].add(forward_s, now)
        if prefill_chunks:
            self.recent["prefill_chunk"].add(step_s, now)

    # the engine's state, read at scrape time
    def register_engine(self, engine: Engine) -> None:
        """Serve `engine`'s gauges and counters from this registry (replacing a previous engine's)."""
        if self._collector is not None:
            self.registry.unregister(self._collector)
        self._collector = EngineCollector(engine)
        self.registry.register(self._collector)
        # vLLM's series exist (at zero) from now on, as vLLM's do from start-up.
        model = engine.cores[0].info.model_name if engine.cores else ""
        self._vllm = {name: h.labels(model_name=model) for name, h in self.vllm_histograms.items()}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


METRICS = SchedulerMetrics()  # the scheduler process's metrics


def observe_step(
    core: EngineCore, plan: StepPlan, result: StepResult, started: float, metrics: SchedulerMetrics | None = None
) -> None:
    """The engine core's per-step hook: call after the worker answered and
    before planner.update() (requests that finish in this step are still live).
    `started` is the time.perf_counter() taken before the Step call."""
    metrics = metrics if metrics is not None else METRICS
    step_s = time.perf_counter() - started
    cm = core_metrics(core)
    now = metrics.clock()
    # Rate sample first: every counter then reflects the previous steps fully
    # applied (this step's tokens are neither computed nor generated yet).
    cm.sample(core, now)
    prefill, decode, chunks = split_step_tokens(plan, core.planner.requests.get)
    cm.prefill_tokens += prefill
    cm.decode_tokens += decode
    cm.first_token_prompt_tokens += first_token_prompt_tokens(plan, core.planner.requests.get)
    metrics.observe_step_timing(cm.worker, step_s, result.forward_ms / 1e3, prefill + decode, chunks, now)


def engine_hooks(metrics: SchedulerMetrics | None = None) -> EngineHooks[EngineCore]:
    """What an Engine needs to feed `metrics` (default: the process's METRICS)."""
    target = metrics if metrics is not None else METRICS

    def on_step(core: EngineCore, plan: StepPlan, result: StepResult, started: float) -> None:
        observe_step(core, plan, result, started, target)

    return EngineHooks(latency=target, on_step=(on_step,), clock=target.clock)
