"""The second KV tier's bookkeeping: the worker's offload pool (--kv-offload-gb),
block ids [0, num_blocks) of its own, seen from the scheduler.

A tier-2 block holds a copy of a block the first tier evicted, under the same
chained hash, until the LRU order (or, with the priority policy, the same
shared-last order as the first tier) reuses it. The index is inclusive: a hash
copied back up stays here too, so a block evicted again from tier 1 costs no
second copy down. A block is held (ref > 0) only while a copy that names it
waits to be sent with the next plan, so that no other copy of that plan
overwrites it; between plans every tier-2 block is free, cached or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler_svc.kv.block import BlockHash, KVBlock
from scheduler_svc.kv.events import BlockRemoved, BlockStored, KVCacheEvent
from scheduler_svc.kv.free_queue import make_free_queue

TierCopy = tuple[int, int]  # (src, dst) block ids


@dataclass(frozen=True, slots=True)
class TierTransfers:
    """One step's copies between the tiers (worker.v1 StepRequest.offloads/onloads).
    The worker runs the offloads first (they read tier-1 blocks this step may
    overwrite), then the onloads, then the step's copy-on-write copies and forward."""

    offloads: tuple[TierCopy, ...] = ()  # (tier-1 block, tier-2 block)
    onloads: tuple[TierCopy, ...] = ()  # (tier-2 block, tier-1 block)
    # The hashes the copies carry, parallel to the lists: what to forget if the step is lost.
    offload_hashes: tuple[BlockHash, ...] = ()
    onload_hashes: tuple[BlockHash, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.offloads or self.onloads)


NO_TRANSFERS = TierTransfers()


class OffloadPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        medium: str,
        eviction_policy: str = "lru",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"an offload pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.medium = medium
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = make_free_queue(eviction_policy, self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # Told of each BlockStored/BlockRemoved (with `medium`); kv/tiers.py records them
        # in order with the first tier's.
        self.on_event: Callable[[KVCacheEvent], None] | None = None
        self.blocks_reclaimed = 0  # cached tier-2 blocks whose hash a new copy dropped (monotonic)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_held_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def free_block_ids(self) -> list[int]:
        """Free queue in eviction order (next to be overwritten first)."""
        return [block.block_id for block in self.free_queue]

    def lookup(self, block_hash: BlockHash) -> int | None:
        block = self.cached.get(block_hash)
        return None if block is None else block.block_id

    def store(self, block_hash: BlockHash, shared: bool) -> int | None:
        """A tier-2 block for a copy of `block_hash` coming down, held until the plan
        is sent; None if the hash is here already (refreshed instead: no copy needed)
        or every block is held by this plan's copies (the hash is then lost, as
        without a second tier)."""
        if (present := self.cached.get(block_hash)) is not None:
            if present.ref_cnt == 0:
                self.free_queue.remove(present)
                self.free_queue.append(present)
            present.shared = present.shared or shared
            return None
        if not len(self.free_queue):
            return None
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._record(BlockRemoved((block.block_hash,), self.medium))
            del self.cached[block.block_hash]
            self.blocks_reclaimed += 1
        block.block_hash, block.shared, block.ref_cnt = block_hash, shared, 1
        self.cached[block_hash] = block
        self._record(BlockStored((block_hash,), None, (), self.block_size, self.medium))
        return block.block_id

    def hold(self, block_id: int) -> None:
        """A copy up reads this block in the plan being built: keep it from being overwritten."""
        block = self.blocks[block_id]
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1
        block.shared = True  # a hit reused it: the priority policy keeps it longer

    def release(self, block_ids: list[int]) -> None:
        """The plan holding these blocks was taken: back to the free queue's tail (most recent)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, f"tier-2 block {block_id} released but not held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def forget(self, block_id: int, block_hash: BlockHash) -> None:
        """The copy that was to fill this block was lost: drop its hash if it still has it."""
        block = self.blocks[block_id]
        if block.block_hash == block_hash:
            del self.cached[block_hash]
            block.block_hash = None
            self._record(BlockRemoved((block_hash,), self.medium))

    def reset(self) -> int:
        """The worker restarted: its offload pool is gone. Returns the hashes dropped."""
        dropped = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return dropped

    def audit(self) -> list[str]:
        """What does not add up (empty: clean). Between plans nothing is held."""
        problems = []
        if held := [b.block_id for b in self.blocks if b.ref_cnt != 0]:
            problems.append(f"tier-2 blocks held between plans: {held}")
        free_ids = [b.block_id for b in self.free_queue]
        if len(free_ids) != len(set(free_ids)) or set(free_ids) != {b.block_id for b in self.blocks if b.ref_cnt == 0}:
            problems.append("tier-2 free queue != set of unheld blocks")
        for block_hash, block in self.cached.items():
            if block.block_hash != block_hash:
                problems.append(f"tier-2 index entry for block {block.block_id} does not match its hash")
        if sum(1 for b in self.blocks if b.block_hash is not None) != len(self.cached):
            problems.append("tier-2 hashed blocks != tier-2 index entries")
        return problems

    def _record(self, event: KVCacheEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)


class SingleTier:
    """The tier-copy part of the KVManager protocol for a KV memory without a
    second tier (the block pool alone, contiguous slots): never any copies."""

    def take_transfers(self) -> TierTransfers:
        return NO_TRANSFERS

    def transfers_applied(self, transfers: TierTransfers) -> None:
        """Nothing to confirm."""

    def transfers_lost(self) -> None:
        """Nothing to forget."""
