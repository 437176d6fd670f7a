"""Pinning a prompt prefix on a worker: compute it once if it is not cached,
then hold its full blocks so they are never evicted (KVCacheManager.pin)."""

from __future__ import annotations

import uuid

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.request import Request, SamplingOptions

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
    """Run the prefix as a one-token request: its full blocks end up in the index."""
    warm = Request(
        f"pin-{uuid.uuid4().hex}",
        seq_id,
        list(prompt_ids),
        SamplingOptions(temperature=0.0, max_tokens=1, ignore_eos=True),
        cache_salt=cache_salt,
    )
    handle = core.add(warm)
    while True:
        event = await handle.events.get()
        if event.finished or event.error:
            return
