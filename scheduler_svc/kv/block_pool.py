"""Physical KV block ids: ref counts, an LRU free queue and the prefix hash index.

The pool knows nothing about requests; KVCacheManager maps requests to blocks.
A block is in exactly one of two states:
  * used   -- ref_cnt > 0, referenced by that many request block tables;
  * free   -- ref_cnt == 0, in the free queue. A free block may still hold a
              hash ("cached-free"): its KV is valid and a later request with the
              same prefix can take it back until allocation evicts it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import structlog

from scheduler_svc.kv.block import BlockHash, KVBlock
from scheduler_svc.kv.events import AllBlocksCleared, BlockRemoved, KVCacheEvent, stored_runs
from scheduler_svc.kv.free_queue import NoFreeBlocksError, make_free_queue

log = structlog.get_logger(__name__)


# Parent of a sequence's first block. sha256 never yields 32 zero bytes in practice.
ROOT_PARENT_HASH: BlockHash = bytes(32)

_EXTRA_KEY_TYPES = (str, int, float, bool, type(None), bytes)


def hash_extra_keys(extra_keys: tuple[object, ...]) -> bytes:
    """Digest of everything besides tokens that changes a block's KV.

    repr() of a tuple of str/int/float/bool/None/bytes is canonical (quoted,
    escaped, typed: ("1",) != (1,), ("a,b",) != ("a", "b")) and does not depend
    on PYTHONHASHSEED, so it is a safe encoding to hash.
    """
    for key in extra_keys:
        if not isinstance(key, _EXTRA_KEY_TYPES):
            raise TypeError(f"extra key {key!r} must be one of str/int/float/bool/None/bytes")
    return hashlib.sha256(repr(tuple(extra_keys)).encode()).digest()


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], extra_digest: bytes) -> BlockHash:
    """Chained content hash of one full block.

    sha256 rather than Python's hash(): a 64-bit hash collision (trivial to
    craft for ints) would silently make one request attend to another's KV --
    wrong output and a cross-request leak. The encoding is unambiguous: two
    fixed 32-byte fields, then the tokens as fixed-width int64.
    """
    digest = hashlib.sha256(parent or ROOT_PARENT_HASH)
    digest.update(extra_digest)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


class DoubleFreeError(ValueError):
    """A block was freed more times than it was referenced."""


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        record_events: bool = False,
    ) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = make_free_queue(eviction_policy, self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}  # the prefix index
        self.num_cached_free_blocks = 0
        self.blocks_reclaimed = 0  # cached blocks reclaimed by allocate() (their hash dropped)
        # Monotonic counters for the metrics (rates come from their deltas):
        # blocks that left the free queue (allocate(), or a cached-free block a
        # prefix hit revived) and blocks that went back to it, so
        # num_used_blocks == blocks_allocated - blocks_freed at all times.
        self.blocks_allocated = 0
        self.blocks_freed = 0
        self.eviction_events = 0  # allocate() calls that reclaimed at least one cached block
        # KV events (kv/events.py): every change of the index, in order, until take_events().
        self.record_events = record_events
        self.events: list[KVCacheEvent] = []
        # Told of each cached block allocate() reclaims, before its hash is dropped and
        # the block reused: a second KV tier (kv/tiers.py) copies it down instead of losing it.
        self.on_evict: Callable[[KVBlock], None] | None = None

    # ---- counters -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now, cached-free ones included."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix index, used or free."""
        return len(self.cached)

    def ref_count(self, block_id: int) -> int:
        return self._block(block_id).ref_cnt

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (next to be allocated first)."""
        return [block.block_id for block in self.free_queue]

    # ---- allocation -----------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Pop `count` blocks off the LRU head, each with ref 1.

        All-or-nothing: raises NoFreeBlocksError before touching anything.
        """
        if count > len(self.free_queue):
            raise NoFreeBlocksError(f"cannot allocate {count} blocks: only {len(self.free_queue)} free")
        evicted: list[BlockHash] = []
        ids = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self.on_evict is not None:
                    self.on_evict(block)
                self._drop_hash(block)
                self.num_cached_free_blocks -= 1
            block.ref_cnt, block.shared = 1, False
            ids.append(block.block_id)
        self.blocks_allocated += count
        if evicted:
            if self.record_events:
                self.events.append(BlockRemoved(tuple(evicted)))
            self.blocks_reclaimed += len(evicted)
            self.eviction_events += 1
            # Debug, not info: under cache pressure this is every allocation (1,600 lines in one
            # load run); the counters above are the metrics pagedserve_kv_blocks_reclaimed_total
            # and the eviction events, which say the same in aggregate.
            log.debug(
                "kv_blocks_evicted",
                blocks_reclaimed=len(evicted),
                blocks_reclaimed_total=self.blocks_reclaimed,
                free_blocks=len(self.free_queue),
            )
        return ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Share blocks: ref +1; a cached-free block leaves the free queue.

        Only a block with live KV can be shared: one already in use, or a
        cached-free one (a prefix hit). An uncached free block holds garbage.
        """
        blocks = [self._block(i) for i in block_ids]
        for block in blocks:
            if block.ref_cnt == 0 and block.block_hash is None:
                raise ValueError(f"block {block.block_id} is free and uncached: nothing to share")
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free_blocks -= 1
                self.blocks_allocated += 1
            block.ref_cnt += 1
            block.shared = True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; blocks reaching 0 join the LRU tail in the given order.

        Checked before any change, so a DoubleFreeError leaves the pool intact.
        Callers pass a request's table tail-first so its deepest blocks are
        evicted before the prefix other requests are likeliest to share.
        """
        ids = list(block_ids)
        for block_id, times in Counter(ids).items():
            block = self._block(block_id)
            if block.ref_cnt < times:
                raise DoubleFreeError(
                    f"block {block_id} freed {times}x but has ref count {block.ref_cnt}"
                    " (double free or never allocated)"
                )
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.blocks_freed += 1
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1

    # ---- prefix index ---------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def cache_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Index a used, full block under its hash. Returns whether it was indexed.

        If another block already holds that content (two equal prompts prefilled
        in the same step), the first one stays the indexed copy and this block
        stays private: the index maps a hash to one block.
        """
        block = self._block(block_id)
        if not self.enable_prefix_caching:
            return False
        if block.ref_cnt == 0:
            raise ValueError(f"block {block_id} is free: only blocks in use can be cached")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def cache_full_blocks(
        self, block_ids: list[int], block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int]
    ) -> None:
        """Index consecutive full blocks of one sequence: block_ids[i] holds the
        tokens token_ids[i * block_size:(i + 1) * block_size] and hashes to
        block_hashes[i], chained on `parent` (None for a sequence's first block).
        Each run of blocks that enter the index is one BlockStored event."""
        new = [
            i
            for i, (block_id, block_hash) in enumerate(zip(block_ids, block_hashes))
            if self._block(block_id).block_hash is None and self.cache_block(block_id, block_hash)
        ]
        if self.record_events and new:
            self.events.extend(stored_runs(new, block_hashes, parent, token_ids, self.block_size))

    def reset_prefix_cache(self) -> int:
        """Forget every hash (a worker restarted with an empty cache). Returns how many."""
        dropped = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_cached_free_blocks = 0
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return dropped

    def uncache(self, block_id: int) -> None:
        """Drop one block's index entry, used or free: its KV never arrived (the
        step that was to copy it up from the second tier was lost)."""
        block = self._block(block_id)
        if block.block_hash is None:
            return
        if block.ref_cnt == 0:
            self.num_cached_free_blocks -= 1
        if self.record_events:
            self.events.append(BlockRemoved((block.block_hash,)))
        self._drop_hash(block)

    def take_events(self) -> list[KVCacheEvent]:
        """The index changes since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def _drop_hash(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = None

    def _block(self, block_id: int) -> KVBlock:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return self.blocks[block_id]
