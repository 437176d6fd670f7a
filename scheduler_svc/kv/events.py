"""KV cache events: what enters and leaves a pool's prefix index, in vLLM's
terms (vllm/distributed/kv_events.py), for routers that track which worker
holds which prefix. The pool records them as its index changes; the engine
takes them once per step (`BlockPool.take_events`) and publishes them.

Hashes are our sha256 chained block hashes (32 bytes, see
block_pool.hash_block_tokens), sent as bytes: vLLM sends either ints or bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_svc.kv.block import BlockHash

# vLLM's name for the KV tier in the accelerator's memory, the one its prefix
# index covers; here: the worker's block pool, whatever its device. The second
# tier (kv/offload.py) says "CPU" (pinned host memory) or "DISK" (a file-backed pool).
MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks of one sequence entered the index, in order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None  # the block before the first one; None: a sequence's first block
    token_ids: tuple[int, ...]  # block_size tokens per hash; () for a second-tier copy (vLLM's offloading does so)
    block_size: int
    medium: str = MEDIUM  # the tier the blocks entered


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the index (evicted: their memory was reused)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM  # the tier the blocks left


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole index was dropped (the worker restarted, or left the scheduler)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_runs(
    new: list[int], block_hashes: list[BlockHash], parent: BlockHash | None, token_ids: list[int], block_size: int
) -> list[BlockStored]:
    """One BlockStored per run of consecutive positions in `new` (ascending
    indexes into `block_hashes`, whose tokens are `token_ids`, block_size each;
    `parent` is the hash before block_hashes[0])."""
    events, start = [], 0
    for i in range(1, len(new) + 1):
        if i == len(new) or new[i] != new[i - 1] + 1:
            first, last = new[start], new[i - 1]
            events.append(
                BlockStored(
                    block_hashes=tuple(block_hashes[first : last + 1]),
                    parent_block_hash=block_hashes[first - 1] if first else parent,
                    token_ids=tuple(token_ids[first * block_size : (last + 1) * block_size]),
                    block_size=block_size,
                )
            )
            start = i
    return events
