"""BlockPool: allocation, ref counts, LRU free queue, prefix index, eviction."""

import pytest

from scheduler_svc.kv.block import KVBlock
from scheduler_svc.kv.block_pool import BlockPool, DoubleFreeError, hash_block_tokens, hash_extra_keys
from scheduler_svc.kv.free_queue import FreeBlockQueue, NoFreeBlocksError

EXTRA = hash_extra_keys(("model", "bf16", None))


def h(tokens, parent=None, extra=EXTRA):
    return hash_block_tokens(parent, tokens, extra)


# ---- allocation / exhaustion / reuse -----------------------------------------
def test_allocate_until_exhausted():
    pool = BlockPool(10, 16)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5
    assert pool.allocate(5) == [5, 6, 7, 8, 9]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 10
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert [pool.ref_count(i) for i in range(10)] == [1] * 10


def test_failed_allocation_changes_nothing():
    pool = BlockPool(4, 16)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.free_block_ids() == [2, 3]


def test_free_restores_and_reuses_freed_ids_in_lru_order():
    pool = BlockPool(4, 16)
    assert pool.allocate(2) == [0, 1]
    pool.free([1, 0])  # appended to the tail in this order
    assert pool.num_free_blocks == 4
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_allocating_zero_and_an_empty_pool():
    pool = BlockPool(10, 16)
    pool.allocate(8)
    assert pool.num_free_blocks == 2
    assert pool.allocate(0) == [] and pool.num_free_blocks == 2
    empty = BlockPool(0, 16)
    assert empty.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        empty.allocate(1)


def test_bad_pool_arguments():
    with pytest.raises(ValueError):
        BlockPool(-1, 16)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


# ---- double free -------------------------------------------------------------
def test_double_free_detected():
    pool = BlockPool(10, 16)
    ids = pool.allocate(3)
    pool.free(ids)
    with pytest.raises(DoubleFreeError):
        pool.free(ids)
    assert pool.num_free_blocks == 10


def test_free_of_never_allocated_block():
    pool = BlockPool(10, 16)
    pool.allocate(1)
    with pytest.raises(DoubleFreeError):
        pool.free([7])


def test_double_free_within_one_call_is_atomic():
    pool = BlockPool(4, 16)
    pool.allocate(2)
    before = pool.free_block_ids()
    with pytest.raises(DoubleFreeError):
        pool.free([0, 1, 1])
    assert pool.free_block_ids() == before
    assert pool.ref_count(0) == 1 and pool.ref_count(1) == 1


def test_out_of_range_block_id():
    pool = BlockPool(4, 16)
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="out of range"):
        pool.ref_count(-1)


def test_shared_block_needs_one_free_per_reference():
    pool = BlockPool(2, 16)
    [b] = pool.allocate(1)
    pool.cache_block(b, h(range(16)))
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.ref_count(b) == 1 and b not in pool.free_block_ids()
    pool.free([b])
    assert pool.ref_count(b) == 0 and pool.free_block_ids() == [1, 0]
    with pytest.raises(DoubleFreeError):
        pool.free([b])


# ---- free queue --------------------------------------------------------------
def test_free_block_queue_is_o1_linked_list():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])  # from the middle
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [1, 3, 4, 2, 0]
    assert blocks[0].prev is not None and blocks[1].prev is not None
    while len(queue):
        queue.popleft()
    with pytest.raises(NoFreeBlocksError):
        queue.popleft()


# ---- hashing -----------------------------------------------------------------
def test_block_hash_is_chained_and_keyed():
    tokens = list(range(16))
    root = h(tokens)
    assert len(root) == 32 and root == h(tokens)
    assert h(tokens, parent=root) != root  # same tokens, other parent
    assert h(tokens[::-1]) != root  # order matters
    assert h(tokens, extra=hash_extra_keys(("model", "fp8", None))) != root  # kv dtype
    assert h(tokens, extra=hash_extra_keys(("model", "bf16", "tenant-a"))) != root  # salt


def test_extra_keys_encoding_is_unambiguous():
    assert hash_extra_keys(("a,b",)) != hash_extra_keys(("a", "b"))
    assert hash_extra_keys((1,)) != hash_extra_keys(("1",))
    assert hash_extra_keys((None,)) != hash_extra_keys(("None",))
    with pytest.raises(TypeError):
        hash_extra_keys((object(),))


# ---- prefix index / cached-free / eviction ------------------------------------
def test_freed_block_keeps_hash_until_allocation_evicts_it():
    pool = BlockPool(3, 16)
    ids = pool.allocate(2)
    h0 = h(range(16))
    assert pool.cache_block(ids[0], h0)
    assert pool.num_cached_blocks == 1 and pool.num_cached_free_blocks == 0
    pool.free(reversed(ids))  # tail first: block 1, then block 0
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.num_cached_free_blocks == 1 and pool.get_cached_block(h0) == 0
    assert pool.allocate(2) == [2, 1] and pool.blocks_reclaimed == 0
    assert pool.allocate(1) == [0]  # the cached-free block goes last
    assert pool.blocks_reclaimed == 1
    assert pool.get_cached_block(h0) is None and pool.blocks[0].block_hash is None
    assert pool.num_cached_blocks == 0 and pool.num_cached_free_blocks == 0


def test_touch_takes_cached_free_block_back():
    pool = BlockPool(3, 16)
    [b] = pool.allocate(1)
    pool.cache_block(b, h(range(16)))
    pool.free([b])
    assert pool.free_block_ids() == [1, 2, 0]
    pool.touch([b])
    assert pool.ref_count(b) == 1 and pool.free_block_ids() == [1, 2]
    assert pool.num_cached_free_blocks == 0 and pool.num_cached_blocks == 1


def test_touch_refuses_uncached_free_block():
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError, match="uncached"):
        pool.touch([0])
    assert pool.free_block_ids() == [0, 1]


def test_duplicate_content_keeps_first_block_indexed():
    pool = BlockPool(2, 16)
    a, b = pool.allocate(2)
    h0 = h(range(16))
    assert pool.cache_block(a, h0)
    assert not pool.cache_block(b, h0)
    assert pool.get_cached_block(h0) == a and pool.blocks[b].block_hash is None
    assert pool.cache_block(a, h0)  # idempotent


def test_only_used_blocks_can_be_cached():
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError):
        pool.cache_block(0, h(range(16)))


def test_prefix_caching_disabled_indexes_nothing():
    pool = BlockPool(2, 16, enable_prefix_caching=False)
    [b] = pool.allocate(1)
    assert not pool.cache_block(b, h(range(16)))
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_drops_every_hash():
    pool = BlockPool(4, 16)
    ids = pool.allocate(3)
    hashes = [h([i] * 16) for i in range(3)]
    for block_id, block_hash in zip(ids, hashes):
        pool.cache_block(block_id, block_hash)
    pool.free([ids[2]])
    assert pool.num_cached_free_blocks == 1
    assert pool.reset_prefix_cache() == 3
    assert pool.num_cached_blocks == 0 and pool.num_cached_free_blocks == 0
    assert all(pool.get_cached_block(x) is None for x in hashes)
    assert all(pool.blocks[i].block_hash is None for i in range(4))
    pool.allocate(2)
    assert pool.blocks_reclaimed == 0  # nothing cached left to evict
