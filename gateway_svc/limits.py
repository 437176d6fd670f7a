"""The gateway's limit on request bodies (--max-request-bytes), as a pure ASGI
middleware: a body that says it is larger (Content-Length) is refused with 413
before a byte of it is read, and one that streams in without saying (chunked) as
soon as more than the limit has arrived. Nothing behind it ever holds more than
the limit of one request in memory, or parses it on the event loop.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway_svc.convert import error_body

TOO_LARGE = 413


def _too_large(max_bytes: int, size: str) -> str:
    return f"request body of {size} bytes is larger than this server takes ({max_bytes}, --max-request-bytes)"


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await _refuse(send, _too_large(self.max_bytes, str(declared)))
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI passes an HTTPException raised while it reads the body through
                    # to the app's handler: a 413 in OpenAI's shape, the rest never read.
                    raise HTTPException(TOO_LARGE, _too_large(self.max_bytes, f"more than {self.max_bytes}"))
            return message

        await self.app(scope, counted, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(send: Send, message: str) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, "request_too_large")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    # Connection: close: the unread body must not be taken for the next request.
    headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": TOO_LARGE, "headers": headers})
    await send({"type": "http.response.body", "body": body})
