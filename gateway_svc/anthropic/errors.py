"""Errors on the /v1/messages routes in Anthropic's shape, {"type": "error", "error":
{"type", "message"}}, as Anthropic's clients read them: every other route answers
OpenAI's. The gateway's refusals are made once, in OpenAI's shape (the edge guard's
401/413/408, validation, the scheduler's status codes); an ASGI middleware rewrites the
error bodies of these routes on their way out, so no refusal is missed, and the message
streams' error events use the same mapping."""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ANTHROPIC_PATHS = "/v1/messages"  # and /v1/messages/count_tokens

# Anthropic's error types (https://docs.anthropic.com/en/api/errors); ours that it names
# otherwise are renamed, and any other is its api_error.
_ANTHROPIC_TYPES = frozenset(
    {
        "invalid_request_error",
        "authentication_error",
        "permission_error",
        "not_found_error",
        "request_too_large",
        "rate_limit_error",
        "timeout_error",
        "api_error",
        "overloaded_error",
    }
)
_BY_CODE = {"model_not_found": "not_found_error", "request_too_large": "request_too_large"}
_BY_STATUS = {408: "timeout_error", 413: "request_too_large"}
_RENAMED = {"service_unavailable_error": "overloaded_error"}


def anthropic_error(openai_body: dict[str, Any], status: int | None = None) -> dict[str, Any]:
    """OpenAI's error body ({"error": {message, type, param, code}}) as Anthropic's."""
    error = openai_body["error"]
    kind = _BY_CODE.get(str(error.get("code"))) or (_BY_STATUS.get(status) if status is not None else None)
    kind = kind or _RENAMED.get(str(error.get("type")), str(error.get("type")))
    kind = kind if kind in _ANTHROPIC_TYPES else "api_error"
    return {"type": "error", "error": {"type": kind, "message": str(error.get("message", ""))}}


class AnthropicErrors:
    """Rewrites the JSON error responses (status >= 400) of the /v1/messages routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(ANTHROPIC_PATHS):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        body = bytearray()

        async def rewriting(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                start = message  # held until the whole body is here (an error body is small)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            rewritten = _rewritten(bytes(body), start["status"])
            headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(rewritten)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": rewritten})

        await self.app(scope, receive, rewriting)


def _is_json(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in start["headers"])


def _rewritten(body: bytes, status: int) -> bytes:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body
    if not isinstance(parsed, dict) or not isinstance(parsed.get("error"), dict) or parsed.get("type") == "error":
        return body  # not an OpenAI error body: nothing to translate
    return json.dumps(anthropic_error(parsed, status), separators=(",", ":")).encode()
