"""Whether each API key gets its own prefix cache (convert.tenant_salt).

Where API keys are configured, tenants must not share cached blocks: a key that
resends another key's prompt would get it from the cache (`cached_tokens`, and a
first token in a fraction of the time), a side channel on other tenants' prompts.
So by default the gateway salts by key whenever keys are in force: its own
--api-key, or the scheduler's --api-keys, which it learns by asking the scheduler
ModelInfo without a key (refused: keys are in force). Without keys anywhere the
cache stays shared, as before: every caller is the same tenant, whatever dummy key
its client sends. --cache-salt-from-api-key forces the salt on,
--share-prefix-cache-across-keys off. While the scheduler cannot say (down), the
gateway salts (it fails closed) and asks again; an answer is kept for
RECHECK_S, so a scheduler restarted with keys is noticed.
"""

from __future__ import annotations

import time

import grpc

from gateway_svc.scheduler_client import Scheduler

RECHECK_S = 30.0
_KEYS_IN_FORCE = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# No answer from the scheduler itself; any other status came past its key check (an older
# scheduler without ModelInfo answers UNIMPLEMENTED): no keys are in force there.
_NO_ANSWER = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


class Tenancy:
    def __init__(self, client: Scheduler, forced: bool | None, gateway_key: bool) -> None:
        """forced: True / False from the flags, None = decide from the keys in force."""
        self._client, self._forced, self._gateway_key = client, forced, gateway_key
        self._known: bool | None = None
        self._known_at = 0.0

    async def isolates(self) -> bool:
        if self._forced is not None:
            return self._forced
        if self._gateway_key:
            return True
        if self._known is not None and time.monotonic() - self._known_at < RECHECK_S:
            return self._known
        try:
            await self._client.model_info(None)
            keyed = False
        except grpc.aio.AioRpcError as err:
            if err.code() in _NO_ANSWER:
                return True  # cannot tell now: salt, and ask again next time
            keyed = err.code() in _KEYS_IN_FORCE
        self._known, self._known_at = keyed, time.monotonic()
        return keyed
