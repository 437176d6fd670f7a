"""Prefix routing over workers with a second KV tier (kv/tiers.py), with real
managers: a prefix that lives only in a worker's second tier counts as a hit there
(it is copied up, not computed), and between equal prefixes the worker holding
more of it in the first tier wins. Routing changes neither tier (audit clean)."""

from __future__ import annotations

from scheduler_svc.engine.router import Candidate, PrefixRouter, RouteReason
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.offload import OffloadPool
from scheduler_svc.kv.tiers import TieredKVCacheManager, tier2_handle
from scheduler_svc.request import Request

BS = 16
KEYS = ("model", "f32")
PROMPT = list(range(1000, 1049))  # 3 full blocks and one token
OTHER = list(range(2000, 2065))  # 4 full blocks and one token


def tiered(num_blocks: int = 5, offload_blocks: int = 8) -> TieredKVCacheManager:
    return TieredKVCacheManager(BlockPool(num_blocks, BS), OffloadPool(offload_blocks, BS, "DISK", "lru"), KEYS)


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Prefill and finish a request as the planner does; its step's tier copies applied."""
    request = Request(rid, hash(rid) % 1000, list(tokens))
    hits, hit_tokens = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - hit_tokens, hits) is not None
    kv.transfers_applied(kv.take_transfers())
    kv.cache_full_blocks(request, request.num_tokens)
    kv.free(request)


def only_in_tier2() -> TieredKVCacheManager:
    """PROMPT's 3 full blocks copied down by OTHER's prefill, gone from tier 1."""
    kv = tiered()
    compute(kv, "p", PROMPT)
    compute(kv, "o", OTHER)
    probe = Request("probe", 1, list(PROMPT))
    hits, tokens = kv.get_computed_blocks(probe)
    assert tokens == 48 and all(b < 0 for b in hits)
    below = [kv.offload.lookup(h) for h in probe.block_hashes[:3]]
    assert hits == [tier2_handle(b) for b in below if b is not None] and len(hits) == 3
    return kv


def test_a_prefix_only_in_the_second_tier_is_a_hit_for_the_router():
    holder = only_in_tier2()
    empty = KVCacheManager(BlockPool(64, BS), extra_keys=KEYS)
    router = PrefixRouter(affinity_ttl_s=0)
    candidates = [Candidate("idle", empty), Candidate("holder", holder, num_running=3)]
    decision = router.route(Request("r", 2, list(PROMPT)), candidates)
    assert (decision.address, decision.reason, decision.cached_tokens) == ("holder", RouteReason.PREFIX, 48)
    # Routing copied nothing and held nothing in either tier.
    assert not holder.take_transfers()
    assert holder.pool.num_used_blocks == 0 and holder.offload.num_cached_blocks == 3
    holder.audit([])


def test_between_equal_prefixes_the_first_tier_wins_over_a_lighter_load():
    below = only_in_tier2()
    above = tiered(num_blocks=16)
    compute(above, "p", PROMPT)
    hits, _ = above.get_computed_blocks(Request("probe", 1, list(PROMPT)))
    assert hits == [0, 1, 2]  # all in tier 1
    router = PrefixRouter(affinity_ttl_s=0)
    candidates = [Candidate("below", below), Candidate("above", above, num_running=2)]
    decision = router.route(Request("r", 2, list(PROMPT)), candidates)
    assert (decision.address, decision.reason, decision.cached_tokens) == ("above", RouteReason.PREFIX, 48)
    # A longer prefix in tier 2 still beats a shorter one in tier 1.
    longer = PROMPT + list(range(3000, 3016))
    compute(below, "longer", longer)  # its 4th block lands in tier 1; the first 3 came up from tier 2
    compute(below, "o2", OTHER)  # and all go down again
    hits, tokens = below.get_computed_blocks(Request("probe2", 3, list(longer) + [7]))
    assert tokens == 64 and any(b < 0 for b in hits)
    decision = router.route(Request("r2", 4, list(longer) + [7]), candidates)
    assert (decision.address, decision.cached_tokens) == ("below", 64)
    below.audit([])
    above.audit([])
