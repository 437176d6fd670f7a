"""One KV block's bookkeeping: what the pool, the prefix index and the free
queue know of it. The tensor behind the id lives on the worker."""

from __future__ import annotations

from dataclasses import dataclass

# sha256 of (parent hash, the block's token ids, extra keys): see block_pool.hash_block_tokens.
BlockHash = bytes


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Reused by a second holder (prefix hit, fork) since it was last allocated:
    # the priority eviction policy keeps such blocks longest.
    shared: bool = False
    in_shared_segment: bool = False
    # Free-queue links; both None while the block is used.
    prev: KVBlock | None = None
    next: KVBlock | None = None
