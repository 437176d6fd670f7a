"""Scheduler metrics: the Stats RPC's observability fields and a Prometheus text
endpoint, from one source.

Two kinds of metrics, as prometheus_client intends:

* **State read at scrape time** (`EngineCollector`, a custom collector): block
  pool gauges, utilization, fragmentation, the monotonic counters the block pool
  and planner keep (blocks allocated/freed, evictions, prefix-cache lookups,
  preemptions, steps, tokens), worker info. Nothing is copied into Prometheus
  objects on the hot path; a scrape reads the engine as it is.
* **Observations from hooks** (`SchedulerMetrics`, histograms): time to first
  token, inter-token latency and end-to-end time per request (from
  `RequestTiming`, which `output.RequestStream` drives: it sees every token event
  of a request), and per step: step time, tokens per step, per-chunk prefill
  time and the worker's forward time (from `observe_step`, which the engine core
  calls once per step).

Per-worker series carry a `worker` label (the worker's address); request-level
histograms are engine-wide (a request can move between workers).

The endpoint (`start_metrics_server`) is a small asyncio HTTP server on the
scheduler's event loop, so a scrape reads planner and pool state on the same
thread that mutates it: no locks and never a half-updated pool. Names follow
the Prometheus conventions: `pagedserve_` prefix, base units (seconds, bytes),
`_total` for counters, `_ratio` for 0..1 fractions. See METRIC_NAMES.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # no runtime import: the engine imports this module
    from scheduler_svc.engine import Engine
    from scheduler_svc.engine_core import EngineCore
    from scheduler_svc.planner import StepPlan
    from scheduler_svc.worker_client import StepResult

log = structlog.get_logger(__name__)

RATE_WINDOW_S = 10.0  # Stats' per-second figures: over the last 10 s
RECENT_WINDOW_S = 60.0  # Stats' p50/p95 figures: observations of the last 60 s...
RECENT_MAX = 2048  # ...at most this many
_SAMPLE_EVERY_S = 0.1  # step-hook rate samples at most this often per worker

# Every name the endpoint serves (histograms also serve _bucket/_count/_sum,
# counters _total and _created, info metrics _info). Documented in README.md.
METRIC_NAMES = {
    # block pool (gauges per worker; state = in_use | cached_free | free, which partition the pool)
    "pagedserve_kv_cache_capacity_blocks": "KV blocks in the worker's pool",
    "pagedserve_kv_cache_blocks": "KV blocks by state: in_use (ref > 0), cached_free (free, still a prefix hit), "
                                  "free (free, empty); they sum to the capacity",
    "pagedserve_kv_cache_pinned_blocks": "blocks held by pinned prefixes",
    "pagedserve_kv_cache_utilization_ratio": "blocks in use / capacity",
    "pagedserve_kv_cache_fragmentation_ratio": "internal fragmentation: unused token slots in blocks in use / "
                                               "their slots (each block once)",
    "pagedserve_kv_cache_allocated_slots": "token slots of the blocks in use (blocks in use x block size)",
    "pagedserve_kv_cache_unused_slots": "token slots of blocks in use that hold no token",
    "pagedserve_kv_cache_tokens": "tokens live requests' block tables cover",
    "pagedserve_kv_blocks_allocated_total": "blocks taken from the free queue (new allocations and cached-free "
                                            "blocks revived by a prefix hit)",
    "pagedserve_kv_blocks_freed_total": "blocks returned to the free queue",
    "pagedserve_kv_evictions_total": "allocations that reclaimed cached-free blocks",
    "pagedserve_kv_blocks_reclaimed_total": "cached-free blocks reclaimed (their prefix-cache entry dropped)",
    # prefix cache
    "pagedserve_prefix_cache_queries_total": "admissions that looked up the prefix index",
    "pagedserve_prefix_cache_query_tokens_total": "prompt tokens those lookups covered",
    "pagedserve_prefix_cache_hit_tokens_total": "prompt tokens found cached",
    "pagedserve_prefix_cache_hit_ratio": "hit tokens / query tokens since start",
    # scheduling
    "pagedserve_requests_running": "requests running (holding blocks)",
    "pagedserve_requests_waiting": "requests queued",
    "pagedserve_preemptions_total": "running requests preempted for lack of blocks",
    "pagedserve_steps_total": "engine steps run",
    "pagedserve_prefill_tokens_total": "tokens computed in prefill chunks (recomputation included)",
    "pagedserve_decode_tokens_total": "tokens computed by decodes",
    "pagedserve_prompt_tokens_total": "prompt tokens of the requests received",
    "pagedserve_generation_tokens_total": "tokens generated",
    "pagedserve_requests_finished_total": "requests ended, by finish_reason (stop, length, abort, error)",
    "pagedserve_step_duration_seconds": "wall time of one engine step (the Step RPC included)",
    "pagedserve_step_tokens": "tokens computed per step",
    "pagedserve_prefill_chunk_duration_seconds": "time of the step that computed a prefill chunk, per chunk",
    # latency
    "pagedserve_time_to_first_token_seconds": "request arrival to its first generated token",
    "pagedserve_inter_token_latency_seconds": "time between two tokens of one request",
    "pagedserve_e2e_request_latency_seconds": "request arrival to its last token (stop and length)",
    # workers
    "pagedserve_worker_forward_duration_seconds": "the worker's forward time per step (from Step timings)",
    "pagedserve_worker_kv_cache_bytes_per_token": "KV bytes per token, all layers, K and V, scales included",
    "pagedserve_worker_kv_cache_bytes": "bytes of the worker's KV pool",
    "pagedserve_worker_healthy": "1 while the worker answers",
    "pagedserve_worker_info": "worker identity: device, model, dtype, kv_dtype (value 1)",
}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0,
                600.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(15))  # 1 .. 16384


# ---- small windows for the Stats RPC ---------------------------------------
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


# ---- hook-fed metrics ------------------------------------------------------
class SchedulerMetrics:
    """Histograms and counters fed by hooks, in their own registry (one per
    scheduler process: `METRICS`), plus recent windows for the Stats RPC."""

    def __init__(self, registry: CollectorRegistry | None = None, clock=time.monotonic):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.clock = clock
        r = self.registry
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds",
                              METRIC_NAMES["pagedserve_time_to_first_token_seconds"], buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("pagedserve_inter_token_latency_seconds",
                             METRIC_NAMES["pagedserve_inter_token_latency_seconds"], buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds",
                             METRIC_NAMES["pagedserve_e2e_request_latency_seconds"], buckets=_E2E_BUCKETS, registry=r)
        self.finished = Counter("pagedserve_requests_finished", METRIC_NAMES["pagedserve_requests_finished_total"],
                                ["finish_reason"], registry=r)
        self.step = Histogram("pagedserve_step_duration_seconds", METRIC_NAMES["pagedserve_step_duration_seconds"],
                              ["worker"], buckets=_STEP_BUCKETS, registry=r)
        self.step_tokens = Histogram("pagedserve_step_tokens", METRIC_NAMES["pagedserve_step_tokens"], ["worker"],
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self.prefill_chunk = Histogram("pagedserve_prefill_chunk_duration_seconds",
                                       METRIC_NAMES["pagedserve_prefill_chunk_duration_seconds"], ["worker"],
                                       buckets=_STEP_BUCKETS, registry=r)
        self.forward = Histogram("pagedserve_worker_forward_duration_seconds",
                                 METRIC_NAMES["pagedserve_worker_forward_duration_seconds"], ["worker"],
                                 buckets=_STEP_BUCKETS, registry=r)
        self.recent = {name: RecentValues() for name in ("ttft", "itl", "e2e", "step", "forward", "step_tokens",
                                                         "prefill_chunk")}
        self._collector: Collector | None = None

    # request level (RequestTiming calls these)
    def observe_ttft(self, seconds: float, now: float) -> None:
        self.ttft.observe(seconds)
        self.recent["ttft"].add(seconds, now)

    def observe_itl(self, seconds: float, now: float) -> None:
        self.itl.observe(seconds)
        self.recent["itl"].add(seconds, now)

    def observe_finish(self, reason: str, e2e_s: float, now: float) -> None:
        self.finished.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):  # an abort's time is the client's, an error's the failure's
            self.e2e.observe(e2e_s)
            self.recent["e2e"].add(e2e_s, now)

    # step level (observe_step calls this)
    def observe_step_timing(self, worker: str, step_s: float, forward_s: float, tokens: int, prefill_chunks: int,
                            now: float) -> None:
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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


METRICS = SchedulerMetrics()  # the scheduler process's metrics


class RequestTiming:
    """Token timestamps of one request stream (a sample of an n > 1 request is
    its own stream): TTFT, inter-token gaps, end-to-end time, observed into
    `metrics` as they happen. `arrival` is the request's arrival (monotonic)."""

    __slots__ = ("arrival", "first_token", "last_token", "num_tokens", "ended", "metrics", "clock")

    def __init__(self, arrival: float | None = None, metrics: SchedulerMetrics | None = None, clock=None):
        self.metrics = metrics if metrics is not None else METRICS
        self.clock = clock or self.metrics.clock
        self.arrival = arrival if arrival is not None else self.clock()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.num_tokens = 0
        self.ended: float | None = None

    def on_tokens(self, count: int) -> None:
        if count <= 0 or self.ended is not None:
            return
        now = self.clock()
        if self.first_token is None:
            self.first_token = now
            self.metrics.observe_ttft(now - self.arrival, now)
        else:
            # An event carrying k tokens spreads its gap over them.
            gap = (now - self.last_token) / count
            for _ in range(count):
                self.metrics.observe_itl(gap, now)
        self.last_token = now
        self.num_tokens += count

    def finish(self, reason: str) -> None:
        if self.ended is not None:
            return
        self.ended = self.clock()
        self.metrics.observe_finish(reason, self.ended - self.arrival, self.ended)

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
        if self.num_tokens > 1:
            out["itl_ms_mean"] = round((self.last_token - self.first_token) / (self.num_tokens - 1) * 1e3, 2)
        return out


# ---- per-worker step accounting --------------------------------------------
@dataclass
class CoreMetrics:
    """What one engine core adds to its planner's and pool's own counters."""
    worker: str
    prefill_tokens: int = 0
    decode_tokens: int = 0
    rates: RateWindow = field(default_factory=RateWindow)
    _sampled_at: float = -math.inf

    def sample(self, core: EngineCore, now: float, force: bool = False) -> tuple[float, ...] | None:
        """Feed the rate window (throttled unless `force`); returns the rates when forced."""
        if not force and now - self._sampled_at < _SAMPLE_EVERY_S:
            return None
        self._sampled_at = now
        values = _rate_values(core, self)
        if force:
            return self.rates.rates(now, values)
        self.rates.observe(now, values)
        return None


def _rate_values(core: EngineCore, cm: CoreMetrics) -> tuple[float, ...]:
    """(blocks allocated, blocks freed, tokens computed, tokens generated): the counters Stats turns into rates."""
    pool = core.planner.kv.pool  # a BlockPool, or a contiguous worker's SlotPool
    return (getattr(pool, "blocks_allocated", 0), getattr(pool, "blocks_freed", 0),
            cm.prefill_tokens + cm.decode_tokens, core.counters.generation_tokens)


def core_metrics(core: EngineCore) -> CoreMetrics:
    """The core's CoreMetrics, created on first use."""
    cm = getattr(core, "metrics", None)
    if not isinstance(cm, CoreMetrics):
        cm = CoreMetrics(core.info.address)
        core.metrics = cm
    return cm


def split_step_tokens(plan: StepPlan, lookup) -> tuple[int, int, int]:
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


def observe_step(core: EngineCore, plan: StepPlan, result: StepResult, started: float,
                 metrics: SchedulerMetrics | None = None) -> None:
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
    prefill, decode, chunks = split_step_tokens(plan, core.planner.get_request)
    cm.prefill_tokens += prefill
    cm.decode_tokens += decode
    metrics.observe_step_timing(cm.worker, step_s, result.forward_ms / 1e3, prefill + decode, chunks, now)


# ---- scrape-time collector -------------------------------------------------
class EngineCollector(Collector):
    """Reads every engine core's pool, planner and counters when scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self):
        return []  # names depend on nothing static; collect() on demand

    def collect(self) -> Iterable:
        cores = list(self.engine.cores)
        families: dict[str, Any] = {}

        def gauge(name: str, labels=("worker",)):
            if name not in families:
                families[name] = GaugeMetricFamily(name, METRIC_NAMES[name], labels=list(labels))
            return families[name]

        def counter(name: str):
            if name not in families:
                families[name] = CounterMetricFamily(name, METRIC_NAMES[name + "_total"], labels=["worker"])
            return families[name]

        info = InfoMetricFamily("pagedserve_worker", METRIC_NAMES["pagedserve_worker_info"],
                                labels=["worker"])
        for core in cores:
            w = [core.info.address]
            u = core.planner.kv.usage()
            cm = core_metrics(core)
            c = core.counters
            gauge("pagedserve_kv_cache_capacity_blocks").add_metric(w, u.num_blocks)
            blocks = gauge("pagedserve_kv_cache_blocks", ("worker", "state"))
            blocks.add_metric(w + ["in_use"], u.used_blocks)
            blocks.add_metric(w + ["cached_free"], u.cached_free_blocks)
            blocks.add_metric(w + ["free"], u.free_blocks - u.cached_free_blocks)
            gauge("pagedserve_kv_cache_pinned_blocks").add_metric(w, u.pinned_blocks)
            gauge("pagedserve_kv_cache_utilization_ratio").add_metric(w, u.used_fraction)
            gauge("pagedserve_kv_cache_fragmentation_ratio").add_metric(w, u.fragmentation)
            gauge("pagedserve_kv_cache_allocated_slots").add_metric(w, u.allocated_slots)
            gauge("pagedserve_kv_cache_unused_slots").add_metric(w, u.unused_slots)
            gauge("pagedserve_kv_cache_tokens").add_metric(w, u.tokens_held)
            counter("pagedserve_kv_blocks_allocated").add_metric(w, u.blocks_allocated)
            counter("pagedserve_kv_blocks_freed").add_metric(w, u.blocks_freed)
            counter("pagedserve_kv_evictions").add_metric(w, u.eviction_events)
            counter("pagedserve_kv_blocks_reclaimed").add_metric(w, u.evictions)
            counter("pagedserve_prefix_cache_queries").add_metric(w, u.prefix_queries)
            counter("pagedserve_prefix_cache_query_tokens").add_metric(w, u.prefix_query_tokens)
            counter("pagedserve_prefix_cache_hit_tokens").add_metric(w, u.prefix_hit_tokens)
            gauge("pagedserve_prefix_cache_hit_ratio").add_metric(w, u.prefix_hit_rate)
            gauge("pagedserve_requests_running").add_metric(w, core.planner.num_running)
            gauge("pagedserve_requests_waiting").add_metric(w, core.planner.num_waiting)
            counter("pagedserve_preemptions").add_metric(w, core.planner.num_preemptions)
            counter("pagedserve_steps").add_metric(w, c.steps_run)
            counter("pagedserve_prefill_tokens").add_metric(w, cm.prefill_tokens)
            counter("pagedserve_decode_tokens").add_metric(w, cm.decode_tokens)
            counter("pagedserve_prompt_tokens").add_metric(w, c.prompt_tokens)
            counter("pagedserve_generation_tokens").add_metric(w, c.generation_tokens)
            per_token = _kv_bytes_per_token(core)
            gauge("pagedserve_worker_kv_cache_bytes_per_token").add_metric(w, per_token)
            gauge("pagedserve_worker_kv_cache_bytes").add_metric(w, core.info.kv_bytes_per_block * u.num_blocks)
            gauge("pagedserve_worker_healthy").add_metric(w, 1.0 if core.healthy else 0.0)
            i = core.info
            info.add_metric(w, {"device": i.device, "model": i.model_name, "model_type": i.model_type,
                                "dtype": i.dtype, "kv_dtype": i.kv_dtype, "block_size": str(i.block_size)})
        yield from families.values()
        yield info


def _kv_bytes_per_token(core: EngineCore) -> float:
    info = core.info
    return info.kv_bytes_per_block / info.block_size if info.block_size else 0.0


# ---- the Stats RPC's fields ------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ObservabilityStats:
    """serving.v1.StatsResponse's observability fields (numbers >= 30); the
    engine's EngineStats extends it and Engine.stats() fills it from stats_fields()."""
    block_utilization: float = 0.0
    fragmentation: float = 0.0
    kv_slots_allocated: int = 0
    kv_slots_unused: int = 0
    blocks_allocated_total: int = 0
    blocks_freed_total: int = 0
    blocks_allocated_per_s: float = 0.0
    blocks_freed_per_s: float = 0.0
    eviction_events: int = 0
    prefill_tokens_total: int = 0
    decode_tokens_total: int = 0
    tokens_per_s: float = 0.0
    generation_tokens_per_s: float = 0.0
    tokens_per_step_mean: float = 0.0
    step_ms_p50: float = 0.0
    step_ms_p95: float = 0.0
    forward_ms_p50: float = 0.0
    forward_ms_p95: float = 0.0
    prefill_chunk_ms_p50: float = 0.0
    prefill_chunk_ms_p95: float = 0.0
    ttft_ms_p50: float = 0.0
    ttft_ms_p95: float = 0.0
    itl_ms_p50: float = 0.0
    itl_ms_p95: float = 0.0
    e2e_ms_p50: float = 0.0
    e2e_ms_p95: float = 0.0
    kv_bytes_per_token: int = 0
    workers: tuple = ()  # one worker_stats() dict per worker


def worker_stats(core: EngineCore, now: float) -> dict[str, Any]:
    """One serving.v1.WorkerStats, as a dict."""
    u = core.planner.kv.usage()
    cm = core_metrics(core)
    alloc_s, freed_s, tokens_s, gen_s = cm.sample(core, now, force=True)
    return dict(
        address=core.info.address, device=core.info.device, model=core.info.model_name,
        kv_dtype=core.info.kv_dtype, healthy=core.healthy, running=core.planner.num_running,
        waiting=core.planner.num_waiting, blocks_total=u.num_blocks, blocks_used=u.used_blocks,
        blocks_cached_free=u.cached_free_blocks, blocks_free=u.free_blocks, blocks_pinned=u.pinned_blocks,
        utilization=u.used_fraction, fragmentation=u.fragmentation,
        kv_bytes_per_token=int(_kv_bytes_per_token(core)), prefix_cache_hit_rate=u.prefix_hit_rate,
        blocks_allocated_per_s=alloc_s, blocks_freed_per_s=freed_s, tokens_per_s=tokens_s,
        generation_tokens_per_s=gen_s, kv_slots_allocated=u.allocated_slots, kv_slots_unused=u.unused_slots,
    )


def stats_fields(engine: Engine, metrics: SchedulerMetrics | None = None) -> dict[str, Any]:
    """The observability fields of serving.v1.StatsResponse (numbers >= 30), engine-wide."""
    metrics = metrics if metrics is not None else METRICS
    now = metrics.clock()
    workers = [worker_stats(core, now) for core in engine.cores]
    usages = [core.planner.kv.usage() for core in engine.cores]
    cms = [core_metrics(core) for core in engine.cores]
    total = sum(u.num_blocks for u in usages)
    allocated = sum(u.allocated_slots for u in usages)
    unused = sum(u.unused_slots for u in usages)
    recent = metrics.recent

    def ms(name: str, q: float) -> float:
        return recent[name].quantile(q, now) * 1e3

    return dict(
        block_utilization=sum(u.used_blocks for u in usages) / total if total else 0.0,
        fragmentation=unused / allocated if allocated else 0.0,
        kv_slots_allocated=allocated,
        kv_slots_unused=unused,
        blocks_allocated_total=sum(u.blocks_allocated for u in usages),
        blocks_freed_total=sum(u.blocks_freed for u in usages),
        blocks_allocated_per_s=sum(w["blocks_allocated_per_s"] for w in workers),
        blocks_freed_per_s=sum(w["blocks_freed_per_s"] for w in workers),
        eviction_events=sum(u.eviction_events for u in usages),
        prefill_tokens_total=sum(cm.prefill_tokens for cm in cms),
        decode_tokens_total=sum(cm.decode_tokens for cm in cms),
        tokens_per_s=sum(w["tokens_per_s"] for w in workers),
        generation_tokens_per_s=sum(w["generation_tokens_per_s"] for w in workers),
        tokens_per_step_mean=recent["step_tokens"].mean(now),
        step_ms_p50=ms("step", 0.5), step_ms_p95=ms("step", 0.95),
        forward_ms_p50=ms("forward", 0.5), forward_ms_p95=ms("forward", 0.95),
        prefill_chunk_ms_p50=ms("prefill_chunk", 0.5), prefill_chunk_ms_p95=ms("prefill_chunk", 0.95),
        ttft_ms_p50=ms("ttft", 0.5), ttft_ms_p95=ms("ttft", 0.95),
        itl_ms_p50=ms("itl", 0.5), itl_ms_p95=ms("itl", 0.95),
        e2e_ms_p50=ms("e2e", 0.5), e2e_ms_p95=ms("e2e", 0.95),
        kv_bytes_per_token=max((w["kv_bytes_per_token"] for w in workers), default=0),
        workers=tuple(workers),
    )


# ---- the /metrics endpoint -------------------------------------------------
_MAX_HEADER_LINES = 100
_READ_TIMEOUT_S = 5.0


async def start_metrics_server(engine: Engine, host: str, port: int,
                               metrics: SchedulerMetrics | None = None) -> asyncio.Server:
    """Serve `GET /metrics` (Prometheus text format) on host:port from the running
    event loop. Returns the asyncio server (close() it to stop); its bound port
    is `server.sockets[0].getsockname()[1]` (port 0 lets the OS pick)."""
    metrics = metrics if metrics is not None else METRICS
    metrics.register_engine(engine)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
            for _ in range(_MAX_HEADER_LINES):
                line = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
                if line in (b"\r\n", b"\n", b""):
                    break
            parts = request_line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
            elif path not in ("/metrics", "/"):
                status, body, ctype = "404 Not Found", b"GET /metrics\n", "text/plain"
            else:
                status, body, ctype = "200 OK", metrics.exposition(), CONTENT_TYPE_LATEST
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    f"Connection: close\r\n\r\n").encode()
            writer.write(head if method == "HEAD" else head + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, UnicodeError):
            pass
        except Exception:  # a collector bug must not kill the server; the scrape just fails
            log.exception("metrics scrape failed")
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    bound = server.sockets[0].getsockname()[1]
    log.info("metrics endpoint ready", url=f"http://{host}:{bound}/metrics")
    return server

