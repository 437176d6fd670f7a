"""API keys on the client API: `authorization: Bearer KEY` metadata.

Every method but the health service needs a configured key; without one, or
with a wrong one, the call ends with UNAUTHENTICATED before the servicer runs.
Health stays open so load balancers and orchestrators can probe without a key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import grpc
import structlog

log = structlog.get_logger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def load_api_keys(keys: str = "", keys_file: str = "") -> frozenset[str]:
    """Comma-separated keys plus a file with one key per line (blank lines and # comments skipped)."""
    found = [k.strip() for k in keys.split(",")]
    if keys_file:
        lines = Path(keys_file).read_text().splitlines()
        found += [line.strip() for line in lines if not line.lstrip().startswith("#")]
    return frozenset(k for k in found if k)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: frozenset[str]):
        if not keys:
            raise ValueError("ApiKeyInterceptor needs at least one key")
        # Compare digests of equal length in constant time, against every key, so
        # neither timing nor early exit tells a caller how close a guess was.
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allows(self, token: str | None) -> bool:
        digest = hashlib.sha256((token or "").encode()).digest()
        matches = [hmac.compare_digest(digest, d) for d in self._digests]
        return token is not None and any(matches)

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        token = bearer_token(details.invocation_metadata)
        if self.allows(token):
            return handler
        why = "missing 'authorization: Bearer <key>' metadata" if token is None else "invalid API key"
        log.warning("request refused", method=details.method, reason=why)
        return refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, why)


def refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code`."""

    async def refuse(request: Any, context: Any) -> None:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: Any) -> AsyncIterator[None]:
        await context.abort(code, message)
        yield  # never reached: makes this an async generator, as streaming handlers are

    kind = (
        ("stream" if handler.request_streaming else "unary")
        + "_"
        + ("stream" if handler.response_streaming else "unary")
    )
    behaviour = refuse_stream if handler.response_streaming else refuse
    # No request deserializer: an unauthenticated payload is never parsed.
    return getattr(grpc, f"{kind}_rpc_method_handler")(behaviour, response_serializer=handler.response_serializer)
