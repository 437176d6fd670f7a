"""Who is calling: the caller's API key, checked against the gateway's --api-key
(by the edge guard, gateway_svc/limits.py, before a byte of the body is read) and
forwarded to the scheduler, which may check it against its own --api-keys."""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.types import Scope

from gateway_svc.errors import OpenAIError

UNAUTHORIZED = 401


def _caller_key(authorization: str, x_api_key: str) -> str | None:
    """'Authorization: Bearer KEY', or 'x-api-key: KEY' as Anthropic's clients send it."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return x_api_key.strip() or None
    return key.strip()


def scope_key(scope: Scope) -> str | None:
    """The caller's key of a request that has not been read yet (the ASGI scope's headers)."""
    headers = {name: value.decode("latin-1") for name, value in scope.get("headers", ())}
    return _caller_key(headers.get(b"authorization", ""), headers.get(b"x-api-key", ""))


def key_matches(given: str | None, api_key: str) -> bool:
    # Constant-time compare: the key must not leak through response timing.
    return hmac.compare_digest((given or "").encode(), api_key.encode())


def invalid_key() -> OpenAIError:
    return OpenAIError(
        UNAUTHORIZED,
        "missing or invalid API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
        "authentication_error",
        None,
        "invalid_api_key",
    )


def forwarded_key(request: Request) -> str | None:
    """The caller's key, passed on so that a scheduler which wants one can check it."""
    key = _caller_key(request.headers.get("authorization", ""), request.headers.get("x-api-key", ""))
    if key is not None and not (key.isascii() and key.isprintable()):
        raise OpenAIError(401, "API key must be printable ASCII", "authentication_error", None, "invalid_api_key")
    return key
