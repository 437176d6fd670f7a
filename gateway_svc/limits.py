"""The gateway's edge, as a pure ASGI middleware in front of every route: who may
call, and how a request body must arrive. In order, before anything parses it:

* the caller's key (--api-key): a request without it is answered 401 from its
  head alone, so an unauthenticated caller costs no body read, JSON parse or
  template work (only /health, /metrics and /openapi.json are open);
* the body's size (--max-request-bytes): one that says it is larger
  (Content-Length) is refused with 413 before a byte of it is read, one that
  streams in without saying (chunked) as soon as more than the limit arrived;
* the body's pace (--body-timeout-s, --body-min-rate): every window of
  --body-timeout-s must bring --body-min-rate x the window in bytes (or the rest
  of the body), else the request is cut with 408. A client that sends part of a
  body and stalls, or trickles it, holds its buffer for one window or two, not
  for ever.

Refusals close the connection: an unread body must not be taken for the next
request. The body read here is handed to the app whole, so nothing behind the
guard waits on a client.
"""

from __future__ import annotations

import asyncio
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway_svc.auth import invalid_key, key_matches, scope_key
from gateway_svc.errors import error_body

TOO_LARGE = 413
TOO_SLOW = 408
# Open without a key: probes, Prometheus and the API description carry no tenant data.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
# Not a client's key but an admin's, which the scheduler's admin.v1 checks (gateway_svc/lora.py).
ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


class _Refused(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


class _Gone(Exception):
    """The client disconnected while sending its body: nobody to answer."""


def _refusal(status: int, message: str, code: str) -> _Refused:
    return _Refused(status, json.dumps(error_body(message, "invalid_request_error", None, code)).encode())


def _too_large(max_bytes: int, size: str) -> _Refused:
    message = f"request body of {size} bytes is larger than this server takes ({max_bytes}, --max-request-bytes)"
    return _refusal(TOO_LARGE, message, "request_too_large")


class EdgeGuard:
    def __init__(self, app: ASGIApp, api_key: str, max_bytes: int, body_timeout_s: float, body_min_rate: int) -> None:
        self.app, self.api_key, self.max_bytes = app, api_key, max_bytes
        self.window_s = body_timeout_s
        self.window_floor = max(1, int(body_min_rate * body_timeout_s))  # bytes each window must bring

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_head(scope)
            body = await self._read_body(receive)
        except _Refused as refused:
            await _refuse(send, refused)
            return
        except _Gone:
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_head(self, scope: Scope) -> None:
        if (
            self.api_key
            and scope["path"] not in PUBLIC_PATHS | ADMIN_PATHS
            and not key_matches(scope_key(scope), self.api_key)
        ):
            error = invalid_key()
            raise _Refused(error.status, json.dumps(error.body()).encode())
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            raise _too_large(self.max_bytes, str(declared))

    async def _read_body(self, receive: Receive) -> bytes:
        body = bytearray()
        window_end, window_bytes = time.monotonic() + self.window_s, 0
        while True:
            try:
                message: Message | None = await asyncio.wait_for(receive(), max(window_end - time.monotonic(), 0))
            except TimeoutError:
                message = None
            if message is not None:
                if message["type"] == "http.disconnect":
                    raise _Gone
                chunk = message.get("body", b"")
                body += chunk
                window_bytes += len(chunk)
                if len(body) > self.max_bytes:
                    raise _too_large(self.max_bytes, f"more than {self.max_bytes}")
                if not message.get("more_body", False):
                    return bytes(body)
            now = time.monotonic()
            if now >= window_end:
                if window_bytes < self.window_floor:
                    raise _refusal(
                        TOO_SLOW,
                        f"the request body arrived too slowly ({window_bytes} bytes in {self.window_s:g} s, "
                        f"{len(body)} in all): this server cuts a body that brings less than {self.window_floor} "
                        "bytes in a window (--body-timeout-s, --body-min-rate)",
                        "request_timeout",
                    )
                window_end, window_bytes = now + self.window_s, 0


def _replay(body: bytes, receive: Receive) -> Receive:
    """The app's receive: the whole body at once, then the client's own messages (a disconnect)."""
    pending = True

    async def replayed() -> Message:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send: Send, refused: _Refused) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(refused.body)).encode())]
    # Connection: close: the unread body must not be taken for the next request.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": refused.body})
