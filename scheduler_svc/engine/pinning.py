"""Pinning a prompt prefix on a worker: compute it once if it is not cached,
then hold its full blocks so they are never evicted (KVCacheManager.pin); and
the ledger of who holds which pin, for how long (PinLedger)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.kv.block_manager import PinLimitExceeded
from scheduler_svc.request import Request, SamplingOptions

log = structlog.get_logger(__name__)

_ATTEMPTS = 3  # the prefix can be evicted between computing and pinning under pressure


async def pin_on_core(
    core: EngineCore, prompt_ids: list[int], cache_salt: str | None, seq_id: int
) -> tuple[bytes, int] | None:
    """(pin id, pinned tokens), or None if the prefix kept being evicted before it
    could be pinned. Raises PinLimitExceeded, RequestRejected, WorkerUnavailable."""
    probe = Request(f"pin-probe-{uuid.uuid4().hex}", seq_id, prompt_ids, cache_salt=cache_salt)
    for _ in range(_ATTEMPTS):
        pinned = core.planner.kv.pin(probe)
        if pinned is not None:
            return pinned
        await _compute(core, prompt_ids, cache_salt, seq_id)
    return None


async def _compute(core: EngineCore, prompt_ids: list[int], cache_salt: str | None, seq_id: int) -> None:
    """Run the prefix as a one-token request: its full blocks end up in the index.
    Its admission finds what either KV tier holds (a second-tier block is copied up,
    not computed). A prefix ending on a block boundary gets one token more, so that
    its last block may be a hit too (the last token of a prompt is always computed)."""
    ids = list(prompt_ids)
    if len(ids) % core.planner.kv.block_size == 0 and len(ids) < core.planner.max_len:
        ids.append(ids[-1])  # any token: it only follows the blocks that are pinned
    warm = Request(
        f"pin-{uuid.uuid4().hex}",
        seq_id,
        ids,
        SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True),
        cache_salt=cache_salt,
    )
    handle = core.add(warm)
    while True:
        event = await handle.events.get()
        if event.finished or event.error:
            return


@dataclass
class _Pin:
    owners: dict[str, asyncio.TimerHandle | None] = field(default_factory=dict)  # owner -> its expiry
    blocks: dict[str, int] = field(default_factory=dict)  # worker -> blocks this pin holds there


class PinLedger:
    """Who holds which pin (issue 35: any client key could pin half the pool, forever).
    An owner (a caller's API key, hashed; "" on an open API) may hold pins of at most
    `share` of each worker's blocks, each for `ttl_s` (0: no expiry), renewed by pinning
    again; only an owner unpins, and the blocks stay pinned while another owner of the
    same prefix holds them. The pool-wide cap (--max-pinned-blocks) stays the KV manager's."""

    def __init__(self, share: float, ttl_s: float, unpin: Callable[[bytes], None]) -> None:
        self.share = share
        self.ttl_s = ttl_s
        self._unpin = unpin  # drops a pin on every worker
        self._pins: dict[bytes, _Pin] = {}

    @staticmethod
    def owner(token: str | None) -> str:
        return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""

    def admit(self, owner: str, pin_id: bytes, blocks: dict[str, int], pool_blocks: dict[str, int]) -> None:
        """`owner` holds `pin_id` (`blocks` per worker, each worker's pool `pool_blocks`) for ttl_s
        from now; pinning again renews. PinLimitExceeded (the pin dropped if no one else holds it)
        if that takes `owner` past its share of a worker."""
        pin = self._pins.get(pin_id)
        if pin is None or owner not in pin.owners:
            for worker, wanted in blocks.items():
                held = sum(p.blocks.get(worker, 0) for p in self._pins.values() if owner in p.owners)
                limit = int(self.share * pool_blocks[worker])
                if held + wanted > limit:
                    if pin is None:
                        self._unpin(pin_id)
                    raise PinLimitExceeded(
                        f"pinning {wanted} more blocks would hold {held + wanted} of worker {worker}'s "
                        f"{pool_blocks[worker]} for this key, over its share {self.share:g} = {limit} "
                        "(--max-pin-share-per-key)"
                    )
            pin = self._pins.setdefault(pin_id, _Pin())
        pin.blocks.update(blocks)
        if (timer := pin.owners.get(owner)) is not None:
            timer.cancel()
        loop = asyncio.get_running_loop()
        pin.owners[owner] = loop.call_later(self.ttl_s, self.release, owner, pin_id) if self.ttl_s else None

    def release(self, owner: str, pin_id: bytes) -> bool:
        """Drop `owner`'s hold (its unpin, or its TTL); the pin goes with its last owner.
        False if `owner` did not hold `pin_id`."""
        pin = self._pins.get(pin_id)
        if pin is None or owner not in pin.owners:
            return False
        if (timer := pin.owners.pop(owner)) is not None:
            timer.cancel()
        if not pin.owners:
            del self._pins[pin_id]
            self._unpin(pin_id)
            log.info("prefix unpinned", pin_id=pin_id.hex())
        return True
