"""The second KV tier's planning (kv/tiers.py, kv/offload.py): which tier-1 block
is copied into which tier-2 block and back, exact ids and ref counts, the
events with their medium, lost steps and resets; audit clean in both tiers."""

import pytest

from scheduler_svc.kv.block_manager import LeakError
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.offload import OffloadPool, TierTransfers
from scheduler_svc.kv.tiers import TieredKVCacheManager, tier2_handle
from scheduler_svc.request import Request

BS = 4


def make(num_blocks=4, offload_blocks=3, policy="lru"):
    pool = BlockPool(num_blocks, BS, eviction_policy=policy, record_events=True)
    offload = OffloadPool(offload_blocks, BS, "DISK", policy)
    return TieredKVCacheManager(pool, offload)


def req(rid, tokens):
    return Request(rid, sum(map(ord, rid)), list(tokens))


def prefill(kv, request):
    """Admit, compute and release a request the way the planner does; its hits."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    kv.record_prefix_lookup(request, num_hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request, request.num_computed_tokens)
    return hits, num_hit


A = list(range(100, 109))  # two full blocks and one token
B = list(range(200, 209))


def test_evicted_cached_blocks_are_copied_down_not_dropped():
    kv = make()
    a = req("a", A)
    prefill(kv, a)
    assert kv.block_table("a") == [0, 1, 2]  # blocks 0 and 1 full, so cached
    kv.free(a)  # tail first: the free queue is 3, 2, 1, 0
    assert not kv.take_transfers()
    b = req("b", B)
    prefill(kv, b)  # takes 3, 2 (uncached) and 1: a's second block is evicted
    assert kv.block_table("b") == [3, 2, 1]
    moved = kv.take_transfers()
    assert (moved.offloads, moved.onloads) == (((1, 0),), ())  # into tier-2 block 0
    kv.transfers_applied(moved)
    assert kv.offload.lookup(a.block_hashes[1]) == 0
    assert kv.pool.get_cached_block(a.block_hashes[1]) is None
    assert kv.pool.get_cached_block(a.block_hashes[0]) == 0  # still in tier 1
    kv.audit(["b"])


def spill_then_hit(kv):
    """a's two cached blocks go down, then a's prompt comes again: (a, a2, copies up)."""
    a = req("a", A)
    prefill(kv, a)
    kv.free(a)  # free queue 3, 2, 1, 0
    b = req("b", B + [1, 2, 3, 4])  # 13 tokens: all four blocks
    prefill(kv, b)  # evicts a's 1 then 0, into tier-2 blocks 0 then 1
    down = kv.take_transfers()
    assert down.offloads == ((1, 0), (0, 1))
    kv.transfers_applied(down)
    kv.free(b)  # b's table [3, 2, 1, 0] reversed: free queue 0 (partial), 1, 2, 3 (b's cached blocks)
    a2 = req("a2", A)
    hits, num_hit = kv.get_computed_blocks(a2)
    assert (hits, num_hit) == ([tier2_handle(1), tier2_handle(0)], 8)
    # Tier-2 blocks 1 and 0 are held for the onloads; the targets are the LRU head, 0 and 1:
    # 1 held b's third block, copied down into the last tier-2 block (2). The block for the
    # last token evicts b's second block (2), which finds no free tier-2 block: forgotten.
    assert kv.allocate_slots(a2, 1, hits) == [2]
    assert kv.block_table("a2") == [0, 1, 2]
    kv.record_prefix_lookup(a2, num_hit)
    return a, a2, kv.take_transfers()


def test_a_tier2_hit_allocates_a_tier1_block_and_onloads_into_it():
    kv = make(num_blocks=4, offload_blocks=3)
    a, a2, up = spill_then_hit(kv)
    assert up.onloads == ((1, 0), (0, 1))
    assert up.offloads == ((1, 2),)
    assert [kv.pool.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert [kv.pool.get_cached_block(h) for h in a.block_hashes[:2]] == [0, 1]
    assert [kv.offload.lookup(h) for h in a.block_hashes[:2]] == [1, 0]  # inclusive: still below too
    assert kv.offload.free_block_ids() == [2, 1, 0]  # released in the plan's order, most recent last
    usage = kv.usage()
    assert (usage.tier2_hit_tokens, usage.prefix_hit_tokens) == (8, 8)
    assert (usage.blocks_offloaded, usage.blocks_onloaded, usage.offload_cached_blocks) == (3, 2, 3)
    kv.transfers_applied(up)
    kv.audit(["a2"])
    kv.free(a2)
    kv.audit([])


def test_events_say_the_medium():
    kv = make()
    a = req("a", A)
    prefill(kv, a)
    kv.free(a)
    kv.take_events()
    b = req("b", B)
    prefill(kv, b)
    kinds = [(type(e).__name__, e.block_hashes, e.medium) for e in kv.take_events()]  # type: ignore[union-attr]
    assert (
        kinds
        == [
            ("BlockStored", (a.block_hashes[1],), "DISK"),  # copied down as tier 1 reclaims it
            ("BlockRemoved", (a.block_hashes[1],), "GPU"),
            ("BlockStored", tuple(b.block_hashes[:2]), "GPU"),
        ]
    )


def test_a_lost_step_forgets_what_its_copies_were_to_fill():
    kv = make(num_blocks=4, offload_blocks=3)
    a, a2, up = spill_then_hit(kv)
    kv.free(a2)
    kv.transfers_lost()  # the step carrying `up` never ran
    assert [kv.pool.blocks[dst].block_hash for _, dst in up.onloads] == [None, None]
    assert [kv.pool.get_cached_block(h) for h in a.block_hashes[:2]] == [None, None]
    assert kv.offload.lookup(up.offload_hashes[0]) is None  # b's third block never arrived below
    # What confirmed steps copied down is still good.
    assert kv.get_computed_blocks(req("a3", A)) == ([tier2_handle(1), tier2_handle(0)], 8)
    kv.audit([])


def test_restart_drops_both_tiers():
    kv = make()
    a = req("a", A)
    prefill(kv, a)
    kv.free(a)
    prefill(kv, req("b", B))
    assert kv.take_transfers().offloads
    assert kv.reset_prefix_cache() == 3 + 1  # a's first and b's two cached blocks in tier 1, a's second below
    assert kv.offload.num_cached_blocks == 0 and kv.get_computed_blocks(req("c", A)) == ([], 0)


def test_tier2_is_lru_and_a_present_hash_costs_no_copy():
    kv = make(num_blocks=2, offload_blocks=2)
    for i, rid in enumerate("abcd"):
        r = req(rid, [10 * i + t for t in range(5)])  # one full block each
        prefill(kv, r)
        kv.free(r)
        kv.transfers_applied(kv.take_transfers())
    # Each request takes both tier-1 blocks, evicting the one before: a, b, c went down in turn.
    first = req("a", list(range(5)))
    assert kv.get_computed_blocks(first) == ([], 0)  # a's copy was the LRU one, overwritten by c's
    second = req("b", [10 + t for t in range(5)])
    hits, _ = kv.get_computed_blocks(second)
    assert len(hits) == 1 and hits[0] < 0
    assert kv.usage().offload_blocks_reclaimed == 1


def test_an_all_or_nothing_refusal_changes_nothing():
    kv = make(num_blocks=3, offload_blocks=2)
    a = req("a", A)
    prefill(kv, a)
    kv.free(a)
    b = req("b", B[:5])
    prefill(kv, b)  # b holds two blocks: a's blocks are evicted down
    kv.transfers_applied(kv.take_transfers())
    again = req("a2", A)
    hits, _ = kv.get_computed_blocks(again)
    assert any(h < 0 for h in hits)
    before = (kv.pool.free_block_ids(), [b.ref_cnt for b in kv.offload.blocks])
    assert kv.allocate_slots(again, 1, hits) is None  # needs 3 tier-1 blocks, 1 is free
    assert (kv.pool.free_block_ids(), [b.ref_cnt for b in kv.offload.blocks]) == before
    assert not kv.take_transfers()
    kv.audit(["b"])


def test_audit_sees_a_copy_decided_and_not_sent():
    kv = make()
    a = req("a", A)
    prefill(kv, a)
    kv.free(a)
    prefill(kv, req("b", B))
    with pytest.raises(LeakError, match="not sent"):
        kv.audit(["b"])


def test_transfers_are_falsy_when_empty():
    assert not TierTransfers() and TierTransfers(offloads=((0, 1),))
