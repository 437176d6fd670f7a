"""Prometheus state read at scrape time: every engine core's pool, planner and
counters, as pagedserve_ series and as vLLM's (names.VLLM_METRIC_NAMES).
Nothing is copied into Prometheus objects on the hot path; a scrape reads the
engine as it is (on the event loop, see exposition.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from scheduler_svc.engine.stats import spec_counters
from scheduler_svc.observability.accounting import core_metrics
from scheduler_svc.observability.lora_metrics import lora_families
from scheduler_svc.observability.names import METRIC_NAMES, VLLM_METRIC_NAMES

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore
    from scheduler_svc.engine.engine import Engine


class EngineCollector(Collector):
    """Reads every engine core's pool, planner and counters when scraped."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # names depend on nothing static; collect() on demand

    def collect(self) -> Iterable[Metric]:
        cores = list(self.engine.cores)
        gauges: dict[str, GaugeMetricFamily] = {}
        counters: dict[str, CounterMetricFamily] = {}

        def gauge(name: str, labels: tuple[str, ...] = ("worker",)) -> GaugeMetricFamily:
            if name not in gauges:
                gauges[name] = GaugeMetricFamily(name, METRIC_NAMES[name], labels=list(labels))
            return gauges[name]

        def counter(name: str) -> CounterMetricFamily:
            if name not in counters:
                counters[name] = CounterMetricFamily(name, METRIC_NAMES[name + "_total"], labels=["worker"])
            return counters[name]

        by_direction = {
            name: CounterMetricFamily(name, METRIC_NAMES[name + "_total"], labels=["worker", "direction"])
            for name in ("pagedserve_kv_offload_bytes", "pagedserve_kv_offload_seconds")
        }
        info = InfoMetricFamily("pagedserve_worker", METRIC_NAMES["pagedserve_worker_info"], labels=["worker"])
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
            counter("pagedserve_kv_blocks_reclaimed").add_metric(w, u.blocks_reclaimed)
            counter("pagedserve_prefix_cache_queries").add_metric(w, u.prefix_queries)
            counter("pagedserve_prefix_cache_query_tokens").add_metric(w, u.prefix_query_tokens)
            counter("pagedserve_prefix_cache_hit_tokens").add_metric(w, u.prefix_hit_tokens)
            gauge("pagedserve_prefix_cache_hit_ratio").add_metric(w, u.prefix_hit_rate)
            gauge("pagedserve_kv_offload_capacity_blocks").add_metric(w, u.offload_blocks)
            gauge("pagedserve_kv_offload_cached_blocks").add_metric(w, u.offload_cached_blocks)
            counter("pagedserve_kv_offload_hit_tokens").add_metric(w, u.tier2_hit_tokens)
            per_block = core.info.kv_bytes_per_block
            for direction, moved, ms in (
                ("offload", u.blocks_offloaded, c.offload_ms),
                ("onload", u.blocks_onloaded, c.onload_ms),
            ):
                by_direction["pagedserve_kv_offload_bytes"].add_metric(w + [direction], moved * per_block)
                by_direction["pagedserve_kv_offload_seconds"].add_metric(w + [direction], ms / 1e3)
            gauge("pagedserve_requests_running").add_metric(w, core.planner.num_running)
            gauge("pagedserve_requests_waiting").add_metric(w, core.planner.num_waiting)
            counter("pagedserve_preemptions").add_metric(w, core.planner.num_preemptions)
            counter("pagedserve_steps").add_metric(w, c.steps_run)
            spec = spec_counters(core)
            counter("pagedserve_spec_decode_drafts").add_metric(w, spec.drafts)
            counter("pagedserve_spec_decode_draft_tokens").add_metric(w, spec.draft_tokens)
            counter("pagedserve_spec_decode_accepted_tokens").add_metric(w, spec.accepted_tokens)
            gauge("pagedserve_spec_decode_acceptance_ratio").add_metric(w, spec.acceptance_rate)
            counter("pagedserve_prefill_tokens").add_metric(w, cm.prefill_tokens)
            counter("pagedserve_decode_tokens").add_metric(w, cm.decode_tokens)
            counter("pagedserve_prompt_tokens").add_metric(w, c.prompt_tokens)
            counter("pagedserve_generation_tokens").add_metric(w, c.generation_tokens)
            per_token = kv_bytes_per_token(core)
            gauge("pagedserve_worker_kv_cache_bytes_per_token").add_metric(w, per_token)
            gauge("pagedserve_worker_kv_cache_bytes").add_metric(w, core.info.kv_bytes_per_block * u.num_blocks)
            gauge("pagedserve_worker_healthy").add_metric(w, 1.0 if core.healthy else 0.0)
            gauge("pagedserve_worker_weights_bytes").add_metric(w, core.info.weights_bytes)
            i = core.info
            info.add_metric(
                w,
                {
                    "device": i.device,
                    "model": i.model_name,
                    "model_type": i.model_type,
                    "dtype": i.dtype,
                    "weight_format": i.weight_format,
                    "kv_dtype": i.kv_dtype,
                    "block_size": str(i.block_size),
                },
            )
        yield from gauges.values()
        yield from counters.values()
        yield from by_direction.values()
        yield info
        yield from transfer_families(cores)
        yield from vllm_families(cores)
        if any(core.planner.adapters is not None for core in cores):  # --enable-lora
            yield from lora_families(cores)


def transfer_families(cores: list[EngineCore]) -> list[Metric]:
    """Disaggregation's block moves, per worker they moved into, by direction (one today)."""
    labels = ["worker", "direction"]
    names = ("handoffs", "bytes", "blocks", "blocks_skipped", "seconds", "failed")
    series = {n: "pagedserve_kv_transfers_failed" if n == "failed" else f"pagedserve_kv_transfer_{n}" for n in names}
    series["handoffs"] = "pagedserve_kv_handoffs"
    counters = {n: CounterMetricFamily(m, METRIC_NAMES[m + "_total"], labels=labels) for n, m in series.items()}
    depth_name = "pagedserve_kv_transfer_queue_depth"
    depth = GaugeMetricFamily(depth_name, METRIC_NAMES[depth_name], labels=labels)
    for core in cores:
        c, key = core.counters.kv_transfers, [core.info.address, "prefill_to_decode"]
        for name, family in counters.items():
            family.add_metric(key, getattr(c, name))
        depth.add_metric(key, c.in_flight)
    return [*counters.values(), depth]


def vllm_families(cores: list[EngineCore]) -> list[Metric]:
    """vLLM's gauges and counters, one series per worker (labels model_name,
    engine = the worker's address), with vLLM's meanings."""
    labels = ["model_name", "engine"]
    gauges = {
        name: GaugeMetricFamily(name, VLLM_METRIC_NAMES[name], labels=labels)
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    }
    # CounterMetricFamily exposes `name` + "_total".
    counters = {
        name: CounterMetricFamily(name.removesuffix("_total"), VLLM_METRIC_NAMES[name], labels=labels)
        for name in VLLM_METRIC_NAMES
        if name.endswith("_total")
    }
    for core in cores:
        w = [core.info.model_name, core.info.address]
        u = core.planner.kv.usage()
        gauges["vllm:num_requests_running"].add_metric(w, core.planner.num_running)
        gauges["vllm:num_requests_waiting"].add_metric(w, core.planner.num_waiting)
        gauges["vllm:kv_cache_usage_perc"].add_metric(w, u.used_fraction)  # blocks in use / all, cached-free = free
        # Tokens, as vLLM counts them: each admission's prompt looked up, and the part found cached.
        counters["vllm:prefix_cache_queries_total"].add_metric(w, u.prefix_query_tokens)
        counters["vllm:prefix_cache_hits_total"].add_metric(w, u.prefix_hit_tokens)
        counters["vllm:num_preemptions_total"].add_metric(w, core.planner.num_preemptions)
        counters["vllm:prompt_tokens_total"].add_metric(w, core_metrics(core).first_token_prompt_tokens)
        counters["vllm:generation_tokens_total"].add_metric(w, core.counters.generation_tokens)
        spec = spec_counters(core)
        counters["vllm:spec_decode_num_drafts_total"].add_metric(w, spec.drafts)
        counters["vllm:spec_decode_num_draft_tokens_total"].add_metric(w, spec.draft_tokens)
        counters["vllm:spec_decode_num_accepted_tokens_total"].add_metric(w, spec.accepted_tokens)
    return [*gauges.values(), *counters.values()]


def kv_bytes_per_token(core: EngineCore) -> float:
    info = core.info
    return info.kv_bytes_per_block / info.block_size if info.block_size else 0.0
