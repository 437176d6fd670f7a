"""The engine-wide counts of the Stats RPC: every worker's pool, planner, core
and speculative decoding counters summed (the observability layer adds its own
fields)."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.planning.speculation import SpecCounters


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    tokens_in_cache: int
    steps_run: int
    requests_finished: int
    preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_workers: int
    blocks_cached_free: int
    blocks_pinned: int
    prefix_cache_queries: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    evictions: int
    tokens_computed: int
    resumed_tokens: int
    recomputed_tokens: int
    spec_decode_drafts: int
    spec_decode_draft_tokens: int
    spec_decode_accepted_tokens: int
    spec_decode_acceptance_rate: float
    spec_decode_mean_accepted_length: float


def spec_counters(core: EngineCore) -> SpecCounters:
    """The worker's speculative decoding totals (zeros when it does not draft)."""
    drafter = core.planner.drafter
    return drafter.counters if drafter is not None else SpecCounters()


def engine_stats(cores: list[EngineCore]) -> EngineStats:
    usages = [c.planner.kv.usage() for c in cores]
    counters = [c.counters for c in cores]
    planners = [c.planner for c in cores]
    query_tokens = sum(u.prefix_query_tokens for u in usages)
    hit_tokens = sum(u.prefix_hit_tokens for u in usages)
    specs = [spec_counters(c) for c in cores]
    # Summed into one SpecCounters: its rate and mean length are then the engine's, not an average of the workers'.
    spec = SpecCounters(
        drafts=sum(s.drafts for s in specs),
        draft_tokens=sum(s.draft_tokens for s in specs),
        accepted_tokens=sum(s.accepted_tokens for s in specs),
    )
    return EngineStats(
        running=sum(p.num_running for p in planners),
        waiting=sum(p.num_waiting for p in planners),
        blocks_total=sum(u.num_blocks for u in usages),
        blocks_used=sum(u.used_blocks for u in usages),
        blocks_free=sum(u.free_blocks for u in usages),
        tokens_in_cache=sum(u.tokens_held for u in usages),
        steps_run=sum(c.steps_run for c in counters),
        requests_finished=sum(c.requests_finished for c in counters),
        preemptions=sum(p.num_preemptions for p in planners),
        prompt_tokens_total=sum(c.prompt_tokens for c in counters),
        generation_tokens_total=sum(c.generation_tokens for c in counters),
        num_workers=len(cores),
        blocks_cached_free=sum(u.cached_free_blocks for u in usages),
        blocks_pinned=sum(u.pinned_blocks for u in usages),
        prefix_cache_queries=sum(u.prefix_queries for u in usages),
        prefix_cache_query_tokens=query_tokens,
        prefix_cache_hit_tokens=hit_tokens,
        prefix_cache_hit_rate=hit_tokens / query_tokens if query_tokens else 0.0,
        evictions=sum(u.blocks_reclaimed for u in usages),
        tokens_computed=sum(c.tokens_computed for c in counters),
        resumed_tokens=sum(p.resumed_tokens for p in planners),
        recomputed_tokens=sum(p.recomputed_tokens for p in planners),
        spec_decode_drafts=spec.drafts,
        spec_decode_draft_tokens=spec.draft_tokens,
        spec_decode_accepted_tokens=spec.accepted_tokens,
        spec_decode_acceptance_rate=spec.acceptance_rate,
        spec_decode_mean_accepted_length=spec.mean_accepted_length,
    )
