"""The observability fields of serving.v1.StatsResponse (numbers >= 30):
per-worker pool figures, rates over the last 10 s, and latency quantiles over
the last 60 s."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from scheduler_svc.engine.counters import TransferCounters
from scheduler_svc.observability.accounting import core_metrics
from scheduler_svc.observability.collector import kv_bytes_per_token
from scheduler_svc.observability.metrics import METRICS, SchedulerMetrics

if TYPE_CHECKING:
    from scheduler_svc.engine.core import EngineCore
    from scheduler_svc.engine.engine import Engine


def worker_stats(core: EngineCore, now: float) -> dict[str, Any]:
    """One serving.v1.WorkerStats, as a dict."""
    u = core.planner.kv.usage()
    cm = core_metrics(core)
    alloc_s, freed_s, tokens_s, gen_s = cm.rates_now(core, now)
    return dict(
        address=core.info.address,
        device=core.info.device,
        model=core.info.model_name,
        kv_dtype=core.info.kv_dtype,
        healthy=core.healthy,
        running=core.planner.num_running,
        waiting=core.planner.num_waiting,
        blocks_total=u.num_blocks,
        blocks_used=u.used_blocks,
        blocks_cached_free=u.cached_free_blocks,
        blocks_free=u.free_blocks,
        blocks_pinned=u.pinned_blocks,
        utilization=u.used_fraction,
        fragmentation=u.fragmentation,
        kv_bytes_per_token=int(kv_bytes_per_token(core)),
        prefix_cache_hit_rate=u.prefix_hit_rate,
        blocks_allocated_per_s=alloc_s,
        blocks_freed_per_s=freed_s,
        tokens_per_s=tokens_s,
        generation_tokens_per_s=gen_s,
        kv_slots_allocated=u.allocated_slots,
        kv_slots_unused=u.unused_slots,
        kv_role=core.info.kv_role,
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
        step_ms_p50=ms("step", 0.5),
        step_ms_p95=ms("step", 0.95),
        forward_ms_p50=ms("forward", 0.5),
        forward_ms_p95=ms("forward", 0.95),
        prefill_chunk_ms_p50=ms("prefill_chunk", 0.5),
        prefill_chunk_ms_p95=ms("prefill_chunk", 0.95),
        ttft_ms_p50=ms("ttft", 0.5),
        ttft_ms_p95=ms("ttft", 0.95),
        itl_ms_p50=ms("itl", 0.5),
        itl_ms_p95=ms("itl", 0.95),
        e2e_ms_p50=ms("e2e", 0.5),
        e2e_ms_p95=ms("e2e", 0.95),
        kv_bytes_per_token=max((w["kv_bytes_per_token"] for w in workers), default=0),
        workers=tuple(workers),
        offload_blocks_total=sum(u.offload_blocks for u in usages),
        offload_blocks_cached=sum(u.offload_cached_blocks for u in usages),
        offload_hit_tokens=sum(u.tier2_hit_tokens for u in usages),
        blocks_offloaded=sum(u.blocks_offloaded for u in usages),
        blocks_onloaded=sum(u.blocks_onloaded for u in usages),
        offload_seconds=sum(core.counters.offload_ms for core in engine.cores) / 1e3,
        onload_seconds=sum(core.counters.onload_ms for core in engine.cores) / 1e3,
        **transfer_fields(engine.cores),
    )


def transfer_fields(cores: list[EngineCore]) -> dict[str, Any]:
    """Disaggregation's block moves, summed over the workers (StatsResponse fields 140+)."""
    c = TransferCounters()
    for core in cores:
        c.add(core.counters.kv_transfers)
    return dict(
        kv_handoffs=c.handoffs,
        kv_handoffs_stayed=c.stayed,
        kv_transfers=c.transfers,
        kv_transfers_failed=c.failed,
        kv_transfer_blocks=c.blocks,
        kv_transfer_blocks_skipped=c.blocks_skipped,
        kv_transfer_bytes=c.bytes,
        kv_transfer_seconds=c.seconds,
        kv_transfer_queue_depth=c.in_flight,
    )
