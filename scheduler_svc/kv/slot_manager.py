"""Slot accounting for a contiguous-layout worker: the baseline the paged cache
is measured against.

The worker's cache is [layers, max_batch, kv_heads, max_seq_len, head_dim]; a
sequence holds one whole slot of max_seq_len positions from admission to the
end, however few tokens it has. So admission needs a free slot, a running
sequence never needs more memory, and there is no prefix sharing. It speaks the
same KVManager protocol as KVCacheManager (scheduler_svc/kv/interface.py): a slot is a
block of max_seq_len tokens, a block table is [slot], a position's slot is
slot * max_seq_len + position.

The one case of sharing is a fork (n > 1 samples of one prompt): the children
share the parent's slot (ref counts) and each copies it into a slot of its own
before its first write (copy-on-write, like a shared partial block in the
paged pool). If no slot is free for that copy, the planner preempts the newest
running request, as it does when the paged pool runs out of blocks.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence

from scheduler_svc.kv.block_manager import KVCacheUsage, LeakError
from scheduler_svc.kv.block_pool import DoubleFreeError
from scheduler_svc.kv.events import KVCacheEvent
from scheduler_svc.kv.offload import SingleTier
from scheduler_svc.request import Request


class SlotPool:
    """max_batch slots of slot_len tokens: ref counts and the free slots
    (lowest id first). Has the PoolState of a BlockPool; nothing is ever cached."""

    enable_prefix_caching = False
    num_cached_free_blocks = 0
    num_cached_blocks = 0
    blocks_reclaimed = 0

    def __init__(self, num_slots: int, slot_len: int) -> None:
        if num_slots < 1 or slot_len < 1:
            raise ValueError(f"need num_slots >= 1 and slot_len >= 1, got {num_slots}, {slot_len}")
        self.num_blocks = num_slots
        self.block_size = slot_len
        self.refs = [0] * num_slots
        self._free = list(range(num_slots))  # a heap
        self.blocks_allocated = 0  # monotonic: slots taken from the free list
        self.blocks_freed = 0  # monotonic: slots returned to it

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        return sorted(self._free)

    def ref_count(self, slot: int) -> int:
        return self.refs[self._check(slot)]

    def allocate(self) -> int | None:
        """A free slot with ref 1, or None if every slot is held."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self.refs[slot] = 1
        self.blocks_allocated += 1
        return slot

    def share(self, slot: int) -> None:
        if self.refs[self._check(slot)] == 0:
            raise ValueError(f"slot {slot} is free: nothing to share")
        self.refs[slot] += 1

    def free(self, slot: int) -> None:
        if self.refs[self._check(slot)] == 0:
            raise DoubleFreeError(f"slot {slot} freed but has ref count 0 (double free or never allocated)")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            heapq.heappush(self._free, slot)
            self.blocks_freed += 1

    def _check(self, slot: int) -> int:
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"slot {slot} out of range [0, {self.num_blocks})")
        return slot


class SlotManager(SingleTier):
    """The KVManager of a contiguous worker (see the module docstring)."""

    def __init__(self, num_slots: int, slot_len: int, extra_keys: tuple[object, ...] = ()) -> None:
        self.pool = SlotPool(num_slots, slot_len)
        self.block_size = slot_len
        self.extra_keys = tuple(extra_keys)
        self.tables: dict[str, int] = {}  # request id -> its slot
        self.pending_copies: list[tuple[int, int]] = []
        self._num_tokens: dict[str, int] = {}  # positions of its slot the request has scheduled

    @property
    def slot_len(self) -> int:
        return self.block_size

    # ---- capacity -------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        return self.slot_len

    @property
    def free_fraction(self) -> float:
        return self.pool.num_free_blocks / self.pool.num_blocks

    def num_tokens_fitting(self, request: Request) -> int:
        slot = self.tables.get(request.request_id)
        # A new sequence needs a free slot; a forked one, a free slot to copy its shared one into.
        needs_slot = slot is None or self.pool.ref_count(slot) > 1
        if needs_slot and not self.pool.num_free_blocks:
            return 0
        return max(0, self.slot_len - request.num_computed_tokens)

    # ---- allocation -----------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """A slot for the request on its first call (None if none is free); later
        calls only check that the tokens stay within it. Returns the slot newly
        taken ([slot], or [] when it already had one)."""
        if new_computed_blocks:
            raise ValueError("a contiguous cache shares no prefix blocks")
        req_id = request.request_id
        end = request.num_computed_tokens + num_new_tokens
        if end > self.slot_len:
            return None
        slot = self.tables.get(req_id)
        new: list[int] = []
        if slot is None or self.pool.ref_count(slot) > 1:
            fresh = self.pool.allocate()
            if fresh is None:
                return None
            if slot is not None:  # copy-on-write of a slot shared by a fork
                self.pending_copies.append((slot, fresh))
                self.pool.free(slot)
            self.tables[req_id] = slot = fresh
            new = [fresh]
        self._num_tokens[req_id] = end
        return new

    def free(self, request: Request) -> None:
        slot = self.tables.pop(request.request_id, None)
        self._num_tokens.pop(request.request_id, None)
        if slot is not None:
            self.pool.free(slot)

    def trim(self, request: Request, num_tokens: int) -> None:
        """A slot is held whole: only the tokens it counts shrink."""
        self._num_tokens[request.request_id] = min(self._num_tokens[request.request_id], num_tokens)

    def fork(self, parent: Request, child: Request) -> None:
        slot = self.tables[parent.request_id]
        self.pool.share(slot)
        self.tables[child.request_id] = slot
        self._num_tokens[child.request_id] = self._num_tokens[parent.request_id]

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ---- views ----------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        slot = self.tables.get(request_id)
        return [] if slot is None else [slot]

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        slot, n = self.tables[request.request_id], self.slot_len
        if end > n:
            raise ValueError(f"{request.request_id}: positions up to {end} but a slot holds {n}")
        return list(range(slot * n + start, slot * n + end))

    def usage(self) -> KVCacheUsage:
        pool, n = self.pool, self.slot_len
        fill: dict[int, int] = {}  # a slot shared by a fork counts once, at its fullest holder
        for request_id, slot in self.tables.items():
            fill[slot] = max(fill.get(slot, 0), self._num_tokens.get(request_id, 0))
        allocated = pool.num_used_blocks * n
        return KVCacheUsage(
            num_blocks=pool.num_blocks,
            block_size=n,
            used_blocks=pool.num_used_blocks,
            free_blocks=pool.num_free_blocks,
            cached_free_blocks=0,
            cached_blocks=0,
            blocks_reclaimed=0,
            num_requests=len(self.tables),
            tokens_held=sum(self._num_tokens.values()),
            allocated_slots=allocated,
            unused_slots=max(0, allocated - sum(fill.values())),
            blocks_allocated=pool.blocks_allocated,
            blocks_freed=pool.blocks_freed,
        )

    def audit(self, live_request_ids: Iterable[str] | None = None) -> None:
        """Every slot's ref count equals the tables naming it; the free slots are
        exactly the ref-0 ones, once each; no table outlives its request."""
        pool, problems = self.pool, []
        refs = Counter(self.tables.values())
        if bad := [s for s in refs if not 0 <= s < pool.num_blocks]:
            problems.append(f"tables name slots out of range: {bad}")
        for slot in range(pool.num_blocks):
            if pool.refs[slot] != refs.get(slot, 0):
                problems.append(f"slot {slot}: ref {pool.refs[slot]} but {refs.get(slot, 0)} tables")
        free = pool.free_block_ids()
        if len(free) != len(set(free)):
            problems.append("free slots listed twice")
        if set(free) != {s for s in range(pool.num_blocks) if pool.refs[s] == 0}:
            problems.append("free slots != set of ref-0 slots")
        if set(self._num_tokens) != set(self.tables):
            problems.append("token counts and tables disagree")
        if live_request_ids is not None:
            if leaked := sorted(set(self.tables) - set(live_request_ids)):
                problems.append(f"slots held by requests that are not live: {leaked}")
        if problems:
            raise LeakError("slot audit failed:\n  " + "\n  ".join(problems))

    # ---- prefix cache: none ---------------------------------------------
    num_pinned_blocks = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        return [], 0

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        pass

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        pass

    def reset_prefix_cache(self) -> int:
        return 0

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def pin(self, request: Request) -> tuple[bytes, int] | None:
        return None

    def unpin(self, pin_id: bytes) -> bool:
        return False
