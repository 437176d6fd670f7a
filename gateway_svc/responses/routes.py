"""POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request runs as chat does (`RunChat`, the chat route's own pipeline: template,
constraints, tool calling, Generate calls), and `ResponsesAnswer` writes its
answer as a response object or as the typed event stream; with store (OpenAI's
default) the response and its conversation are kept for GET and for a later
previous_response_id.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway_svc import structured
from gateway_svc.chat_output import ChatOutput
from gateway_svc.convert import Sample
from gateway_svc.errors import OpenAIError
from gateway_svc.generation import Generation, answer_steps, guarded
from gateway_svc.openai_types import ChatCompletionRequest
from gateway_svc.openapi import ERROR_RESPONSES, GENERATION_RESPONSES
from gateway_svc.responses.items import ITEMS, chat_request, new_id, output_items, response_object, usage
from gateway_svc.responses.store import ResponseStore
from gateway_svc.responses.stream import ResponseEvents
from gateway_svc.responses.types import ResponsesRequest
from gateway_svc.results import Results

# The chat route's pipeline: (chat request, HTTP request, answer) -> the HTTP response.
RunChat = Callable[[ChatCompletionRequest, Request, Any], Awaitable[Response]]


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", param, "not_found")


class ResponsesAnswer:
    """One response: its id, how its answer reads, and what it stores at the end."""

    def __init__(
        self,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        reading: ChatOutput,
        model: str,
        conversation: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.id = new_id("resp")
        self.created = int(time.time())
        self._body, self._chat, self._reading, self._model = body, chat, reading, model
        self._conversation, self._store = conversation, store

    def _finish(self, output: list[dict[str, Any]], reason: str | None, results: Results) -> dict[str, Any]:
        response = response_object(
            self.id, self.created, self._model, self._body, output, reason, usage(results.usage())
        )
        if self._body.store:
            said = [item for item in output if item["type"] != "reasoning"]
            self._store.put(response, self._conversation + said)
        return response

    def body(self, results: Results) -> dict[str, Any]:
        [choice] = results.choices.values()
        message, _ = self._reading.message("".join(choice.text), choice.finish_reason)
        return self._finish(output_items(message, choice.finish_reason), choice.finish_reason, results)

    def sse(self, generation: Generation, samples: list[Sample]) -> AsyncIterator[str]:
        events = ResponseEvents()
        return guarded(self._events(events, generation, samples), lambda error: events.event("error", **error))

    async def _events(
        self, events: ResponseEvents, generation: Generation, samples: list[Sample]
    ) -> AsyncIterator[str]:
        started = response_object(self.id, self.created, self._model, self._body, [], None, None)
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        async for step in answer_steps(generation, samples, self._reading):
            for event in events.delta(step.delta):
                yield event
            if step.finished:
                for event in events.close("incomplete" if step.reason == "length" else "completed"):
                    yield event
                response = self._finish(events.output, step.reason, step.results)
                done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield events.event(done, response=response)


def responses_router(
    run_chat: RunChat,
    parsers: structured.Parsers,
    store: ResponseStore,
    model: str,
    served: Callable[[str | None], None],
) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        served(body.model)
        earlier: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            stored = store.get(body.previous_response_id)
            if stored is None:
                raise not_found(body.previous_response_id, "previous_response_id")
            earlier = stored.conversation
        given = [item.model_dump(exclude_none=True, by_alias=True) for item in body.items]
        conversation = earlier + given
        chat = chat_request(body, ITEMS.validate_python(conversation))
        answer = ResponsesAnswer(body, chat, structured.chat_reading(chat, parsers), model, conversation, store)
        return await run_chat(chat, request, answer)

    @router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get(response_id: str) -> dict[str, Any]:
        stored = store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return stored.response

    @router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
