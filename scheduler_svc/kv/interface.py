"""The scheduler's view of one worker's KV memory, whatever its layout.

The planner (and the router, engine and admin services through `planner.kv`)
depend only on this protocol. Two implementations, picked from the worker's
Info.kv_layout by engine._planner():

* KVCacheManager (scheduler_svc/kv/block_manager.py) over a BlockPool: the paged
  layout -- blocks of block_size tokens allocated as tokens are scheduled, prefix
  sharing with ref counts, copy-on-write, eviction.
* SlotManager (scheduler_svc/kv/slot_manager.py): the contiguous layout -- one slot
  of max_seq_len tokens held by a sequence for its whole life; no prefix sharing.

Both speak in "blocks": a contiguous slot is a block of max_seq_len tokens, so a
contiguous sequence's block table is [slot] and its slot mapping
slot * max_seq_len + position, and the worker's Step contract is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from scheduler_svc.kv.block_manager import KVCacheUsage
    from scheduler_svc.kv.events import KVCacheEvent
    from scheduler_svc.kv.offload import TierTransfers
    from scheduler_svc.request import Request


@runtime_checkable
class PoolState(Protocol):
    """Read-only counters of the physical pool (blocks, or contiguous slots), for
    routing, health checks and metrics."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_cached_free_blocks(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int: ...


@runtime_checkable
class KVManager(Protocol):
    """Maps requests to the worker's KV memory: allocation, views, prefix cache, checks."""

    block_size: int  # tokens per block table entry (a contiguous slot: max_seq_len)
    extra_keys: tuple[object, ...]  # what besides tokens keys a cached block (the router groups workers by it)

    @property
    def pool(self) -> PoolState: ...

    # ---- capacity ---------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """Most tokens one request can ever hold (alone in the pool)."""

    @property
    def free_fraction(self) -> float:
        """Share of the pool free now, in [0, 1] (dynamic chunk sizing)."""

    def num_tokens_fitting(self, request: Request) -> int:
        """How many new tokens the request could get slots for right now."""

    # ---- allocation -------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Room for `num_new_tokens` after the request's computed tokens (after
        prefix hits `new_computed_blocks`); None, with nothing changed, if it does
        not fit now."""

    def free(self, request: Request) -> None:
        """Release everything the request holds (no-op if nothing)."""

    def trim(self, request: Request, num_tokens: int) -> None:
        """Keep room for the request's first `num_tokens` tokens only, releasing what
        held positions past them (speculative decoding's rejected drafts)."""

    def fork(self, parent: Request, child: Request) -> None:
        """The child starts from the parent's computed tokens, sharing its memory."""

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies decided since the last call (copy-on-write)."""

    # ---- a second tier (kv/tiers.py; kv/offload.SingleTier without one) ----
    def take_transfers(self) -> TierTransfers:
        """Copies between the tiers decided since the last call, for the next plan."""

    def transfers_applied(self, transfers: TierTransfers) -> None:
        """The step carrying `transfers` came back."""

    def transfers_lost(self) -> None:
        """The steps in flight were lost: forget what their copies were to fill."""

    # ---- views ------------------------------------------------------------
    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's table ([] if it holds nothing)."""

    def slot_mapping(self, request: Request, start: int, end: int) -> list[int]:
        """Physical slot of each position in [start, end)."""

    def usage(self) -> KVCacheUsage: ...

    def audit(self, live_request_ids: Iterable[str] | None = None) -> None:
        """Raise LeakError unless the bookkeeping adds up."""

    # ---- prefix cache (no-ops where there is none) ------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]: ...

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None: ...

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None: ...

    def reset_prefix_cache(self) -> int: ...

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix index's changes since the last call (kv/events.py), oldest first."""

    def pin(self, request: Request) -> tuple[bytes, int] | None: ...

    def unpin(self, pin_id: bytes) -> bool: ...
