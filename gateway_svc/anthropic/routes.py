"""POST /v1/messages and /v1/messages/count_tokens.

A request runs as chat does (the chat route's pipeline) and `MessagesAnswer` writes its
answer as an Anthropic message, or as Anthropic's event stream: message_start,
content_block_start / content_block_delta (text_delta, input_json_delta) /
content_block_stop per block, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway_svc import structured
from gateway_svc.anthropic.convert import chat_request, content_blocks, new_id, stop_reason, usage
from gateway_svc.anthropic.errors import anthropic_error
from gateway_svc.anthropic.types import CountTokensRequest, MessagesRequest
from gateway_svc.chat_output import ChatOutput
from gateway_svc.convert import Sample
from gateway_svc.generation import Generation, answer_steps, guarded
from gateway_svc.openai_types import ChatCompletionRequest
from gateway_svc.openapi import ERROR_RESPONSES, GENERATION_RESPONSES
from gateway_svc.results import Results

RunChat = Callable[[ChatCompletionRequest, Request, Any], Awaitable[Response]]
CountPrompt = Callable[[ChatCompletionRequest, Request], Awaitable[int]]


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"


class MessagesAnswer:
    def __init__(self, reading: ChatOutput, model: str, prompt_tokens: int) -> None:
        self.id = new_id("msg")
        self._reading, self._model, self._prompt_tokens = reading, model, prompt_tokens

    def _message(
        self, content: list[dict[str, Any]], reason: str | None, stop: str | None, used: dict[str, Any]
    ) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self._model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": used}  # fmt: skip

    def body(self, results: Results) -> dict[str, Any]:
        [choice] = results.choices.values()
        message, called = self._reading.message("".join(choice.text), choice.finish_reason)
        reason = stop_reason(choice.finish_reason, called, choice.stop_string)
        return self._message(content_blocks(message), reason, choice.stop_string, usage(results.usage()))

    def sse(self, generation: Generation, samples: list[Sample]) -> AsyncIterator[str]:
        return guarded(self._events(generation, samples), lambda error: _event("error", **_error_fields(error)))

    async def _events(self, generation: Generation, samples: list[Sample]) -> AsyncIterator[str]:
        start = {"input_tokens": self._prompt_tokens, "output_tokens": 0}
        yield _event("message_start", message=self._message([], None, None, start))
        blocks = _Blocks()
        async for step in answer_steps(generation, samples, self._reading):
            for event in blocks.delta(step.delta):
                yield event
            if step.finished:
                for event in blocks.close():
                    yield event
                [choice] = step.results.choices.values()
                stop = choice.stop_string
                end = {"stop_reason": stop_reason(step.reason, step.called, stop), "stop_sequence": stop}
                yield _event("message_delta", delta=end, usage=usage(step.results.usage()))
                yield _event("message_stop")


class _Blocks:
    """The content blocks of one streamed message, one open at a time."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None  # the open block's type

    def delta(self, delta: dict[str, Any]) -> Iterator[str]:
        if delta.get("content"):
            if self._open != "text":
                yield from self._start({"type": "text", "text": ""})
            yield _event(
                "content_block_delta", index=self._index, delta={"type": "text_delta", "text": delta["content"]}
            )
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function", {})
            if piece.get("id") is not None:
                yield from self._start({"type": "tool_use", "id": piece["id"], "name": function["name"], "input": {}})
            if function.get("arguments"):
                json_delta = {"type": "input_json_delta", "partial_json": function["arguments"]}
                yield _event("content_block_delta", index=self._index, delta=json_delta)

    def close(self) -> Iterator[str]:
        if self._open is not None:
            yield _event("content_block_stop", index=self._index)
            self._open = None

    def _start(self, block: dict[str, Any]) -> Iterator[str]:
        yield from self.close()
        self._index += 1
        self._open = block["type"]
        yield _event("content_block_start", index=self._index, content_block=block)


def _error_fields(openai_body: dict[str, Any]) -> dict[str, Any]:
    """An error event's fields besides its type: Anthropic's error object."""
    return {"error": anthropic_error(openai_body)["error"]}


def messages_router(
    run_chat: RunChat, count_prompt: CountPrompt, parsers: structured.Parsers, served: Callable[[str | None], None]
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", responses=GENERATION_RESPONSES)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        served(body.model)
        chat = chat_request(body)
        prompt_tokens = await count_prompt(chat, request) if body.stream else 0
        return await run_chat(chat, request, MessagesAnswer(structured.chat_reading(chat, parsers), body.model,
                                                            prompt_tokens))  # fmt: skip

    @router.post("/v1/messages/count_tokens", responses=ERROR_RESPONSES)
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
        served(body.model)
        return {"input_tokens": await count_prompt(chat_request(body), request)}

    return router
