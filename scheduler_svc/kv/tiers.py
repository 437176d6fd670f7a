"""The prefix cache over two tiers: the worker's block pool (tier 1) and its
offload pool (tier 2, kv/offload.py).

* A cached block tier 1 evicts (BlockPool.on_evict) is copied down into a tier-2
  block instead of being forgotten: an offload (tier-1 block -> tier-2 block) in
  the next plan, which the worker runs before that step writes the reused block.
* A prefix lookup walks the request's block hashes through tier 1, then tier 2.
  A tier-2 hit is handed out as an opaque negative id (-1 - tier-2 block) that
  only allocate_slots reads: it then allocates a tier-1 block, indexes it under
  the hash and adds an onload (tier-2 block -> tier-1 block) to the plan, which
  the worker runs before the forward that reads it. Such tokens are cached
  tokens like any other hit.
* The copies ride in the plan (take_transfers). Their hashes are indexed when
  planned, as the step that fills them runs before any step reading them; if
  that step is lost (transfers_lost) they are forgotten, never served stale.
* Pinned blocks hold a reference, so tier 1 never evicts them: a pinned prefix
  stays pinned (in tier 1) whatever tier 2 does.
* The offload pool belongs to the worker: reset_prefix_cache (a restart) drops
  both tiers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import replace

from scheduler_svc.kv.block import KVBlock
from scheduler_svc.kv.block_manager import KVCacheManager, KVCacheUsage, LeakError
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.events import KVCacheEvent
from scheduler_svc.kv.offload import NO_TRANSFERS, OffloadPool, TierCopy, TierTransfers
from scheduler_svc.request import Request


def tier2_handle(block_id: int) -> int:
    """The id get_computed_blocks hands out for a tier-2 hit."""
    return -1 - block_id


class TieredKVCacheManager(KVCacheManager):
    def __init__(
        self,
        pool: BlockPool,
        offload: OffloadPool,
        extra_keys: tuple[object, ...] = (),
        max_pinned_blocks: int | None = None,
    ) -> None:
        if offload.block_size != pool.block_size:
            raise ValueError(f"offload block_size {offload.block_size} != pool block_size {pool.block_size}")
        super().__init__(pool, extra_keys=extra_keys, max_pinned_blocks=max_pinned_blocks)
        self.offload = offload
        pool.on_evict = self._copy_down
        offload.on_event = self._record_event
        self._offloads: list[TierCopy] = []
        self._onloads: list[TierCopy] = []
        self._offload_hashes: list[bytes] = []
        self._onload_hashes: list[bytes] = []
        # Transfers sent and not yet known done, oldest first: forgotten if their step is lost.
        self._unconfirmed: deque[TierTransfers] = deque()
        # Tier-2 hits of the last allocate_slots: admission records the lookup right after it.
        self._last_tier2_hits = 0
        # Monotonic counters (the metrics): blocks copied each way, tokens found in tier 2.
        self.blocks_offloaded = 0
        self.blocks_onloaded = 0
        self.tier2_hit_tokens = 0  # first admissions' prefix hits served from tier 2 (of prefix_hit_tokens)

    # ---- tier 1 -> tier 2 ------------------------------------------------
    def _copy_down(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        dst = self.offload.store(block.block_hash, block.shared)
        if dst is not None:
            self._offloads.append((block.block_id, dst))
            self._offload_hashes.append(block.block_hash)

    def _record_event(self, event: KVCacheEvent) -> None:
        if self.pool.record_events:
            self.pool.events.append(event)

    # ---- prefix lookup over both tiers ------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest prefix cached in either tier; tier-2 hits as tier2_handle ids."""
        if not self.pool.enable_prefix_caching:
            return [], 0
        max_blocks = request.max_cache_hit_tokens // self.block_size
        hashes, hits = self._block_hashes(request, max_blocks), []
        for block_hash in hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None and (below := self.offload.lookup(block_hash)) is not None:
                block_id = tier2_handle(below)
            if block_id is None:
                break
            hits.append(block_id)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """As KVCacheManager.allocate_slots; tier-2 hits among `new_computed_blocks`
        get a tier-1 block each and an onload, all or nothing."""
        below = [i for i, b in enumerate(new_computed_blocks) if b < 0]
        self._last_tier2_hits = len(below)
        if not below:
            return super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        hits = list(new_computed_blocks)
        needed = self.num_new_blocks_needed(request, num_new_tokens, len(hits))
        leaving = sum(1 for b in hits if b >= 0 and self.pool.ref_count(b) == 0)
        if needed + len(below) > self.pool.num_free_blocks - leaving:
            return None
        above = [b for b in hits if b >= 0]
        # Held first: allocating the onload targets may evict (and copy down), and must
        # neither evict these tier-1 hits nor copy into these tier-2 sources.
        self.pool.touch(above)
        for index in below:
            self.offload.hold(-1 - hits[index])
        targets = self.pool.allocate(len(below))
        hashes = self._block_hashes(request, len(hits))
        for index, dst in zip(below, targets):
            src = -1 - hits[index]
            parent = hashes[index - 1] if index else None
            tokens = request.all_token_ids[index * self.block_size : (index + 1) * self.block_size]
            self.pool.cache_full_blocks([dst], [hashes[index]], parent, tokens)
            self._onloads.append((src, dst))
            self._onload_hashes.append(hashes[index])
            hits[index] = dst
        # Every hit now sits in tier 1 with a reference of ours; hand them back to the
        # free queue's tail so the plain path shares them (ref 1 each), nothing evicting them between.
        self.pool.free(reversed(above + targets))
        new_blocks = super().allocate_slots(request, num_new_tokens, hits)
        assert new_blocks is not None, "counted above"
        return new_blocks

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        super().record_prefix_lookup(request, num_hit_tokens)
        if self.pool.enable_prefix_caching:
            self.tier2_hit_tokens += self._last_tier2_hits * self.block_size

    # ---- the plan's copies -------------------------------------------------
    def take_transfers(self) -> TierTransfers:
        """The copies between the tiers decided since the last call, for the next plan."""
        if not (self._offloads or self._onloads):
            return NO_TRANSFERS
        transfers = TierTransfers(
            tuple(self._offloads), tuple(self._onloads), tuple(self._offload_hashes), tuple(self._onload_hashes)
        )
        self.offload.release([dst for _, dst in self._offloads] + [src for src, _ in self._onloads])
        self._offloads, self._onloads, self._offload_hashes, self._onload_hashes = [], [], [], []
        self.blocks_offloaded += len(transfers.offloads)
        self.blocks_onloaded += len(transfers.onloads)
        self._unconfirmed.append(transfers)
        return transfers

    def transfers_applied(self, transfers: TierTransfers) -> None:
        """The step carrying `transfers` came back: its copies are done."""
        # Steps come back in the order they were sent, so this is the oldest.
        if transfers and self._unconfirmed and self._unconfirmed[0] is transfers:
            self._unconfirmed.popleft()
        elif transfers:
            raise LeakError("tier copies confirmed out of step order")

    def transfers_lost(self) -> None:
        """The steps in flight were lost: what their copies were to fill holds garbage."""
        while self._unconfirmed:
            transfers = self._unconfirmed.popleft()
            for (_, dst), block_hash in zip(transfers.offloads, transfers.offload_hashes):
                self.offload.forget(dst, block_hash)
            for (_, dst), block_hash in zip(transfers.onloads, transfers.onload_hashes):
                if self.pool.blocks[dst].block_hash == block_hash:
                    self.pool.uncache(dst)

    def reset_prefix_cache(self) -> int:
        """The worker restarted: both tiers are gone (and any copy not yet sent with them)."""
        self.offload.release([dst for _, dst in self._offloads] + [src for src, _ in self._onloads])
        self._offloads, self._onloads, self._offload_hashes, self._onload_hashes = [], [], [], []
        self._unconfirmed.clear()
        return super().reset_prefix_cache() + self.offload.reset()

    # ---- views and checks --------------------------------------------------
    def usage(self) -> KVCacheUsage:
        return replace(
            super().usage(),
            offload_blocks=self.offload.num_blocks,
            offload_cached_blocks=self.offload.num_cached_blocks,
            offload_blocks_reclaimed=self.offload.blocks_reclaimed,
            blocks_offloaded=self.blocks_offloaded,
            blocks_onloaded=self.blocks_onloaded,
            tier2_hit_tokens=self.tier2_hit_tokens,
        )

    def audit(self, live_request_ids: Iterable[str] | None = None) -> None:
        """KVCacheManager.audit, plus tier 2's own books, and no copy left unsent."""
        super().audit(live_request_ids)
        problems = self.offload.audit()
        if self._offloads or self._onloads:
            problems.append(f"tier copies decided but not sent: {self._offloads} down, {self._onloads} up")
        if problems:
            raise LeakError("KV tier-2 audit failed:\n  " + "\n  ".join(problems))
