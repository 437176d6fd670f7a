"""Maps requests to blocks: block tables, lazy allocation, prefix lookup, audit."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler_svc.kv.block import BlockHash
from scheduler_svc.kv.block_pool import BlockPool, hash_block_tokens, hash_extra_keys
from scheduler_svc.kv.events import KVCacheEvent
from scheduler_svc.kv.offload import SingleTier
from scheduler_svc.request import Request


class LeakError(AssertionError):
    """audit() found a block whose bookkeeping does not add up."""


class PinLimitExceeded(RuntimeError):
    """Pinning would hold more than max_pinned_blocks blocks (RESOURCE_EXHAUSTED)."""


@dataclass(slots=True, frozen=True)
class KVCacheUsage:
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int  # includes cached_free_blocks
    cached_free_blocks: int  # free but still a prefix hit until evicted
    cached_blocks: int  # in the prefix index, used or free
    blocks_reclaimed: int  # cached blocks whose prefix entry an allocation dropped (monotonic)
    num_requests: int  # requests holding a block table
    tokens_held: int  # tokens live requests' tables cover (shared blocks counted per request)
    pinned_blocks: int = 0
    prefix_queries: int = 0  # admissions that looked up the prefix index
    prefix_query_tokens: int = 0  # prompt tokens those lookups covered
    prefix_hit_tokens: int = 0  # of which found cached
    # Internal fragmentation: every block in use counted once (a shared block at
    # its fullest holder's fill, a pinned block full); free blocks do not count.
    allocated_slots: int = 0  # used_blocks * block_size
    unused_slots: int = 0  # slots of blocks in use that hold no token
    blocks_allocated: int = 0  # total blocks taken from the free queue (monotonic)
    blocks_freed: int = 0  # total blocks returned to it (monotonic)
    eviction_events: int = 0  # allocations that reclaimed cached blocks (blocks_reclaimed counts the blocks)
    # The second tier (kv/tiers.py; all 0 without one):
    offload_blocks: int = 0  # its size
    offload_cached_blocks: int = 0  # holding a copy (in its index)
    offload_blocks_reclaimed: int = 0  # copies a newer copy overwrote (monotonic)
    blocks_offloaded: int = 0  # copied down (monotonic)
    blocks_onloaded: int = 0  # copied up (monotonic)
    tier2_hit_tokens: int = 0  # of prefix_hit_tokens, found in tier 2

    @property
    def fragmentation(self) -> float:
        """Unused token slots in allocated blocks / allocated slots (0 with nothing allocated)."""
        return self.unused_slots / self.allocated_slots if self.allocated_slots else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def used_fraction(self) -> float:
        return self.used_blocks / self.num_blocks if self.num_blocks else 0.0


class KVCacheManager(SingleTier):
    def __init__(
        self,
        pool: BlockPool,
        block_size: int | None = None,
        extra_keys: tuple[object, ...] = (),
        max_pinned_blocks: int | None = None,
    ) -> None:
        """extra_keys: everything besides tokens that changes KV (model identity, kv dtype)."""
        if block_size is not None and block_size != pool.block_size:
            raise ValueError(f"block_size {block_size} != pool block_size {pool.block_size}")
        self.pool = pool
        self.block_size = pool.block_size
        self.extra_keys = tuple(extra_keys)
        self.max_pinned_blocks = pool.num_blocks // 2 if max_pinned_blocks is None else max_pinned_blocks
        self.tables: dict[str, list[int]] = {}
        self.pins: dict[bytes, list[int]] = {}  # pin id (hash of its last block) -> blocks it holds
        # Block copies (src, dst) that copy-on-write decided; the next plan carries them.
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = self.prefix_query_tokens = self.prefix_hit_tokens = 0
        self._num_hashed_blocks: dict[str, int] = {}  # leading table blocks already indexed
        self._num_table_tokens: dict[str, int] = {}  # tokens the table has slots for

    # ---- prefix cache ---------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request's known tokens: (block ids, tokens).

        No side effects. At most request.max_cache_hit_tokens: the last known
        token is always recomputed because its logits are needed, and so are the
        positions whose prompt logprobs a request still needs.
        """
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_blocks = request.max_cache_hit_tokens // self.block_size
        hashes, hits = self._block_hashes(request, max_blocks), []
        for i in range(max_blocks):
            block_id = self.pool.get_cached_block(hashes[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's lookup for the hit-rate metrics (first admission only)."""
        if self.pool.enable_prefix_caching:
            self.prefix_queries += 1
            self.prefix_query_tokens += request.num_prompt_tokens
            self.prefix_hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the blocks that became full once `num_computed_tokens` were computed.

        Done after every step, so a prefill interrupted between chunks resumes
        from its last computed full block via the index.
        """
        if not self.pool.enable_prefix_caching:
            return
        table = self.tables[request.request_id]
        start = self._num_hashed_blocks[request.request_id]
        end = min(num_computed_tokens // self.block_size, len(table))
        if end <= start:
            return
        hashes = self._block_hashes(request, end)
        tokens = request.all_token_ids[start * self.block_size : end * self.block_size]
        self.pool.cache_full_blocks(table[start:end], hashes[start:end], hashes[start - 1] if start else None, tokens)
        self._num_hashed_blocks[request.request_id] = end

    def reset_prefix_cache(self) -> int:
        """The worker's cache is gone: forget every hash, and the pins with them
        (their blocks hold nothing valid any more)."""
        for pin_id in list(self.pins):
            self.unpin(pin_id)
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    # ---- pinning --------------------------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return len({b for blocks in self.pins.values() for b in blocks})

    def pin(self, request: Request) -> tuple[bytes, int] | None:
        """Pin the cached full blocks of the request's tokens so they are never
        evicted. Returns (pin id, pinned tokens), or None if its prefix is not
        (fully) cached yet -- compute it first. Pinning the same prefix twice is
        one pin."""
        num_full = request.num_tokens // self.block_size
        if not self.pool.enable_prefix_caching or num_full == 0:
            return None
        hashes = self._block_hashes(request, num_full)
        found = [self.pool.get_cached_block(h) for h in hashes[:num_full]]
        blocks = [b for b in found if b is not None]
        if len(blocks) < len(found):
            return None
        pin_id = hashes[num_full - 1]
        if pin_id not in self.pins:
            new = set(blocks) - {b for held in self.pins.values() for b in held}
            if self.num_pinned_blocks + len(new) > self.max_pinned_blocks:
                raise PinLimitExceeded(
                    f"pinning {len(new)} more blocks would exceed max_pinned_blocks="
                    f"{self.max_pinned_blocks} ({self.num_pinned_blocks} pinned)"
                )
            self.pool.touch(blocks)
            self.pins[pin_id] = blocks
        return pin_id, num_full * self.block_size

    def unpin(self, pin_id: bytes) -> bool:
        blocks = self.pins.pop(pin_id, None)
        if blocks is None:
            return False
        self.pool.free(reversed(blocks))
        return True

    # ---- parallel samples -----------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's whole block table, sharing every block
        (ref +1). A later write into a shared partial block copies it first."""
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        self._num_hashed_blocks[child.request_id] = self._num_hashed_blocks[parent.request_id]
        self._num_table_tokens[child.request_id] = self._num_table_tokens[parent.request_id]
        child.block_hashes = list(parent.block_hashes)

    # ---- capacity (the KVManager protocol, scheduler_svc/kv/interface.py) --------
    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request can hold: the whole pool."""
        return self.pool.num_blocks * self.block_size

    @property
    def free_fraction(self) -> float:
        return self.pool.num_free_blocks / self.pool.num_blocks if self.pool.num_blocks else 0.0

    # ---- allocation -----------------------------------------------------
    def num_new_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        total_tokens = request.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        have = len(self.tables.get(request.request_id, ())) + num_hit_blocks
        return max(0, -(-total_tokens // self.block_size) - have)

    def num_tokens_fitting(self, request: Request) -> int:
        """How many new tokens the request could get slots for right now."""
        table = self.tables.get(request.request_id, ())
        slack = len(table) * self.block_size - request.num_computed_tokens
        return slack + self.pool.num_free_blocks * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Give the request slots for `num_new_tokens` after its computed tokens.

        `new_computed_blocks` are prefix hits (from get_computed_blocks) to share
        first; they sit right after request.num_computed_tokens. Only the blocks
        needed for the tokens scheduled now are allocated (never max_tokens up
        front). Returns the newly allocated ids ([] if the last block has room),
        or None -- with nothing changed -- if the free queue is too short.
        """
        shared_partial = self._shared_partial_block(request) if not new_computed_blocks else None
        if not new_computed_blocks and shared_partial is None and self._table_has_room(request, num_new_tokens):
            # Most decode steps: the last block has room and is the request's own.
            self._num_table_tokens[request.request_id] = request.num_computed_tokens + num_new_tokens
            return []
        needed = self.num_new_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # A hit sitting in the free queue stops being free once shared.
        hits_leaving_free_queue = sum(1 for b in new_computed_blocks if self.pool.ref_count(b) == 0)
        if needed + (shared_partial is not None) > self.pool.num_free_blocks - hits_leaving_free_queue:
            return None
        req_id = request.request_id
        if shared_partial is not None:
            self._copy_on_write(request, shared_partial)
        table = self.tables.setdefault(req_id, [])
        if not table:
            self._num_hashed_blocks[req_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise ValueError(f"{req_id}: prefix hits can only start a block table")
        self.pool.touch(new_computed_blocks)
        table.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(needed)
        table.extend(new_blocks)
        self._num_table_tokens[req_id] = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        )
        return new_blocks

    def _table_has_room(self, request: Request, num_new_tokens: int) -> bool:
        table = self.tables.get(request.request_id)
        return table is not None and request.num_computed_tokens + num_new_tokens <= len(table) * self.block_size

    def _shared_partial_block(self, request: Request) -> int | None:
        """Index in the table of the partly filled block the next token goes
        into, if another table shares it (so writing would corrupt theirs)."""
        table = self.tables.get(request.request_id)
        index = request.num_computed_tokens // self.block_size
        if not table or request.num_computed_tokens % self.block_size == 0 or index >= len(table):
            return None
        return index if self.pool.ref_count(table[index]) > 1 else None

    def _copy_on_write(self, request: Request, index: int) -> None:
        table = self.tables[request.request_id]
        src = table[index]
        (dst,) = self.pool.allocate(1)
        table[index] = dst
        self.pool.free([src])
        self.pending_copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (see BlockPool.free). No-op if it has none."""
        table = self.tables.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        self._num_table_tokens.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` tokens, tail first. They
        held only positions that were allocated for a step and then not kept
        (rejected drafts): never full with kept tokens, so never indexed."""
        req_id = request.request_id
        table, keep = self.tables[req_id], -(-num_tokens // self.block_size)
        assert keep >= self._num_hashed_blocks[req_id], (req_id, keep, "an indexed block would be released")
        if tail := table[keep:]:
            del table[keep:]
            self.pool.free(reversed(tail))
        self._num_table_tokens[req_id] = min(self._num_table_tokens[req_id], num_tokens)

    # ---- views ----------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        """A copy: the live table keeps growing after a plan is built."""
        return list(self.tables.get(request_id, ()))

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Physical slot (block * block_size + offset) of each position in [start, end)."""
        table, bs = self.tables[request.request_id], self.block_size
        if end > len(table) * bs:
            raise ValueError(f"{request.request_id}: positions up to {end} but table covers {len(table) * bs}")
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def filled_slots(self) -> int:
        """Token slots holding (or scheduled to hold) a token, over the blocks in
        use, each block counted once: a block shared by several tables counts at
        the fill of its fullest holder; a pinned block is full."""
        bs, fill = self.block_size, dict[int, int]()
        for request_id, table in self.tables.items():
            tokens = self._num_table_tokens.get(request_id, 0)
            for i, block_id in enumerate(table):
                filled = min(bs, max(0, tokens - i * bs))
                if filled > fill.get(block_id, -1):
                    fill[block_id] = filled
        for blocks in self.pins.values():
            for block_id in blocks:
                fill[block_id] = bs
        return sum(fill.values())

    def usage(self) -> KVCacheUsage:
        pool = self.pool
        allocated_slots = pool.num_used_blocks * self.block_size
        return KVCacheUsage(
            num_blocks=pool.num_blocks,
            block_size=self.block_size,
            used_blocks=pool.num_used_blocks,
            free_blocks=pool.num_free_blocks,
            cached_free_blocks=pool.num_cached_free_blocks,
            cached_blocks=pool.num_cached_blocks,
            blocks_reclaimed=pool.blocks_reclaimed,
            num_requests=len(self.tables),
            tokens_held=sum(self._num_table_tokens.values()),
            pinned_blocks=self.num_pinned_blocks,
            prefix_queries=self.prefix_queries,
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            allocated_slots=allocated_slots,
            unused_slots=max(0, allocated_slots - self.filled_slots()),
            blocks_allocated=pool.blocks_allocated,
            blocks_freed=pool.blocks_freed,
            eviction_events=pool.eviction_events,
        )

    # ---- audit ----------------------------------------------------------
    def audit(self, live_request_ids: Iterable[str] | None = None) -> None:
        """Prove the bookkeeping adds up; raise LeakError with details otherwise.

        * every block's ref count equals the number of table and pin entries naming it;
        * the free queue holds exactly the ref-0 blocks, once each, so free and
          used blocks partition [0, num_blocks);
        * the index points only at blocks carrying that hash, and every hashed
          block is indexed; the cached-free counter matches;
        * with live_request_ids: no table belongs to a request no longer live.
        """
        pool, problems = self.pool, []
        refs = Counter(b for table in [*self.tables.values(), *self.pins.values()] for b in table)
        for block in pool.blocks:
            if block.ref_cnt != (table_refs := refs.get(block.block_id, 0)):
                problems.append(f"block {block.block_id}: ref {block.ref_cnt} but {table_refs} table/pin refs")
        if bad := [b for b in refs if not 0 <= b < pool.num_blocks]:
            problems.append(f"tables name blocks out of range: {bad}")
        free_ids = pool.free_block_ids()
        if len(free_ids) != len(set(free_ids)) or len(free_ids) != len(pool.free_queue):
            problems.append("free queue has duplicates or a wrong length")
        if set(free_ids) != {b.block_id for b in pool.blocks if b.ref_cnt == 0}:
            problems.append("free queue != set of ref-0 blocks")
        for block_hash, block in pool.cached.items():
            if block.block_hash != block_hash:
                problems.append(f"index entry for block {block.block_id} does not match its hash")
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        if len(hashed) != len(pool.cached):
            problems.append(f"{len(hashed)} hashed blocks but {len(pool.cached)} index entries")
        if pool.num_cached_free_blocks != sum(1 for b in hashed if b.ref_cnt == 0):
            problems.append("num_cached_free_blocks counter is off")
        if live_request_ids is not None:
            if leaked := sorted(set(self.tables) - set(live_request_ids)):
                problems.append(f"tables held by requests that are not live: {leaked}")
        if problems:
            raise LeakError("KV cache audit failed:\n  " + "\n  ".join(problems))

    # ---- internals ------------------------------------------------------
    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's hash cache, extended to cover at least `num_blocks` full blocks."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        if len(hashes) < num_blocks:
            # The salt goes into every block's key; chaining alone would suffice,
            # but this keeps each key self-describing at no real cost.
            # An adapter changes every layer's K and V: its blocks never meet the base's or another adapter's.
            lora = () if request.lora is None else (request.lora.name, request.lora.digest)
            extra = hash_extra_keys(self.extra_keys + (request.cache_salt,) + lora)
            parent = hashes[-1] if hashes else None
            for i in range(len(hashes), num_blocks):
                parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], extra)
                hashes.append(parent)
        return hashes
