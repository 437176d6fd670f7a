"""The FastAPI app: OpenAI routes over a Scheduler (one, or a pool).

Routes parse and validate (openai_types), convert (convert), run the Generate
calls (generation) and answer as JSON or server-sent events. Every error leaves
as OpenAI error JSON with the matching HTTP status (error_handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Annotated, Any

import grpc
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway_svc import convert, errors, structured
from gateway_svc.anthropic.errors import AnthropicErrors
from gateway_svc.anthropic.routes import MessagesAnswer, messages_router
from gateway_svc.auth import forwarded_key
from gateway_svc.bodies import JsonBody
from gateway_svc.chat_template import ChatTemplate
from gateway_svc.config import GatewayConfig
from gateway_svc.convert import Sample
from gateway_svc.embeddings import embeddings_router
from gateway_svc.error_handlers import add_error_handlers
from gateway_svc.generation import (
    Generation,
    LiveGenerations,
    guarded,
    prompt_token_counts,
)
from gateway_svc.limits import EdgeGuard
from gateway_svc.lora import LoraModels, lora_admin_router
from gateway_svc.metrics import SchedulerMetrics, install_metrics
from gateway_svc.openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway_svc.openapi import (
    ERROR_RESPONSES,
    GATEWAY_VERSION,
    GENERATION_RESPONSES,
    HEALTH_RESPONSES,
    publish_openapi,
)
from gateway_svc.responses.routes import ResponsesAnswer, responses_router
from gateway_svc.responses.store import ResponseStore
from gateway_svc.results import ResponseShape, Results
from gateway_svc.scheduler_client import Scheduler
from gateway_svc.tenancy import Tenancy
from gateway_svc.tokenize import model_info, tokenize_router

log = structlog.get_logger("gateway")

# Tell proxies not to buffer the event stream (each chunk must reach the client now).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Module globals: the routes' annotations name them (a string annotation sees no locals).
COMPLETION_BODY, CHAT_BODY = JsonBody(CompletionRequest), JsonBody(ChatCompletionRequest)


def create_app(client: Scheduler, config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="pagedserve gateway", version=GATEWAY_VERSION, docs_url=None, redoc_url=None)
    template = config.template()
    if config.model_dir and template is None:
        log.warning("no chat template: /v1/chat/completions will answer 400", model_dir=config.model_dir)
    started = int(time.time())
    # `model`: the base (--model-name) or one of the scheduler's LoRA adapters; embeddings: the base only.
    lora = LoraModels(config.model_id)
    served = lora.served
    parsers = config.parsers()
    live = LiveGenerations()
    app.state.live = live  # the server drains them on shutdown (server.py)
    rules = convert.RequestRules(
        config.max_n, config.max_prompts, chat_default_max_tokens=config.default_max_tokens, base_model=config.model_id
    )
    tenancy = Tenancy(client, config.tenant_salt_forced, bool(config.api_key))
    bounds = config.max_parallel_per_request, config.max_stream_buffer_bytes

    @app.post("/v1/completions", responses=GENERATION_RESPONSES, openapi_extra=COMPLETION_BODY.openapi_extra)
    async def completions(body: Annotated[CompletionRequest, Depends(COMPLETION_BODY)], request: Request) -> Response:
        await lora.learn(client, body.model, forwarded_key(request))
        served(body.model)
        shape = ResponseShape("completion", body.model or config.model_id)
        constraint, field = structured.constraint_fields(body, parsers)
        salted = replace(rules, cache_salt_from_api_key=await tenancy.isolates())
        samples = convert.completion_samples(body, shape.id, salted, forwarded_key(request), constraint)
        return await _generate(client, live, request, body, shape, samples, bounds, field)

    async def prompt(body: ChatCompletionRequest) -> str:
        tools = [t.for_template() for t in body.tools or []] if body.tool_mode != "none" else None
        return await _render_chat(template, body, tools)

    async def prompt_tokens(body: ChatCompletionRequest, request: Request) -> int:
        """The rendered prompt's tokens, as Generate counts them."""
        reply = await client.tokenize(await prompt(body), True, False, forwarded_key(request))
        return len(reply.token_ids)

    async def run_chat(body: ChatCompletionRequest, request: Request, shape: Answer) -> Response:
        """A chat request's pipeline (chat completions, and the APIs answered over it)."""
        rendered = await prompt(body)
        constraint, field = structured.constraint_fields(body, parsers, rendered)
        salted = replace(rules, cache_salt_from_api_key=await tenancy.isolates())
        samples = convert.chat_samples(body, rendered, shape.id, salted, forwarded_key(request), constraint)
        return await _generate(client, live, request, body, shape, samples, bounds, field)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES, openapi_extra=CHAT_BODY.openapi_extra)
    async def chat_completions(
        body: Annotated[ChatCompletionRequest, Depends(CHAT_BODY)], request: Request
    ) -> Response:
        await lora.learn(client, body.model, forwarded_key(request))
        served(body.model)
        return await run_chat(
            body, request, ResponseShape("chat", body.model or config.model_id, structured.chat_reading(body, parsers))
        )

    async def model_card(request: Request) -> dict[str, Any]:
        """The base's card (with max_model_len when the scheduler can say); the adapters' names learnt."""
        card = {"id": config.model_id, "object": "model", "created": started, "owned_by": "pagedserve"}
        info = await model_info(client, forwarded_key(request))
        if info is None:
            return card
        lora.learnt(info)
        return (
            card
            | {"max_model_len": info.max_model_len}
            | ({"weight_format": info.weight_format} if info.weight_format else {})
        )

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [await model_card(request), *lora.cards(started)]}

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        await lora.learn(client, model_id, forwarded_key(request))
        lora.served(model_id)
        return await model_card(request) if model_id == config.model_id else lora.card(model_id, started)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        ok, why = await client.check_health(config.api_key or None)
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": f"scheduler {client.target}: {why}"}, status_code=503)

    app.include_router(tokenize_router(client, template, forwarded_key, served))
    store = ResponseStore(config.responses_store_size, config.responses_store_ttl_s)
    app.include_router(responses_router(run_chat, parsers, store, config.model_id, served))
    app.include_router(messages_router(run_chat, prompt_tokens, parsers, served))
    base_only = _model_checker(config.model_id)
    score_template = template if config.chat_template else None  # a yes/no reranker's pairs (vLLM's score template)
    app.include_router(
        embeddings_router(client, config.model_id, forwarded_key, base_only, config.max_prompts, score_template)
    )
    if config.scheduler_admin:
        app.include_router(lora_admin_router(lora, client, config.scheduler_admin, config.admin_credentials()))
    # The caller's key, the body's size and pace are checked before anything reads or parses
    # the body (401, 413, 408), inside the metrics' count.
    app.add_middleware(
        EdgeGuard,
        api_key=config.api_key,
        max_bytes=config.max_request_bytes,
        body_timeout_s=config.body_timeout_s,
        body_min_rate=config.body_min_rate,
    )
    # Outside the guard: its refusals on the /v1/messages routes are rewritten too.
    app.add_middleware(AnthropicErrors)
    install_metrics(app, SchedulerMetrics(config.scheduler_metrics, config.health_timeout_s))
    add_error_handlers(app)
    publish_openapi(app)
    return app


# Messages longer than this (characters, all of them), or more of them than this, are
# rendered in a worker thread: the template's Python code then shares the GIL in slices
# instead of holding the loop. Both count: 150,000 empty messages are seconds of template.
RENDER_INLINE_CHARS = 65_536
RENDER_INLINE_MESSAGES = 256


async def _render_chat(
    template: ChatTemplate | None, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> str:
    small = len(body.messages) <= RENDER_INLINE_MESSAGES
    if small and sum(len(m.content or "") for m in body.messages) <= RENDER_INLINE_CHARS:
        return convert.chat_prompt(template, body.messages, body, tools)
    return await asyncio.to_thread(convert.chat_prompt, template, body.messages, body, tools)


def _model_checker(model_id: str) -> Callable[[str | None], None]:
    """One model per gateway: a request may leave `model` out or name it; another name is a 404."""

    def served(model: str | None) -> None:
        if model and model != model_id:
            raise errors.model_not_found(model)

    return served


# ---------------------------------------------------------------- generation


# How a generation answers: OpenAI's completions and chat shape, or another API's (responses).
Answer = ResponseShape | ResponsesAnswer | MessagesAnswer


async def _generate(
    client: Scheduler,
    live: LiveGenerations,
    request: Request,
    body: SamplingFields,
    shape: Answer,
    samples: list[Sample],
    bounds: tuple[int, int],
    constraint_field: str | None = None,
) -> Response:
    """`bounds`: the calls at once and the unread bytes at most (--max-parallel-per-request,
    --max-stream-buffer-bytes); `constraint_field`: the request field a structured-output
    constraint came from, named when the scheduler refuses the constraint."""
    generation = Generation(client, samples, forwarded_key(request), *bounds)
    live.add(generation)
    try:
        if body.stream:
            async with _cancel_on_disconnect(request, generation.cancel):
                await generation.start()
                counts = (
                    await prompt_token_counts(client, samples, forwarded_key(request))
                    if body.continuous_usage
                    else None
                )
            if isinstance(shape, ResponseShape):
                stream = _sse(generation, shape, samples, body.include_usage, counts)
            else:
                stream = shape.sse(generation, samples)
            return _GenerationStream(generation, stream, lambda: live.discard(generation))
        results = Results(samples)
        async with _cancel_on_disconnect(request, generation.cancel):
            async for index, message in generation.events():
                results.add(index, message)
        live.discard(generation)
        return JSONResponse(shape.body(results))
    except grpc.aio.AioRpcError as err:
        generation.cancel()
        live.discard(generation)
        error = errors.grpc_error(err.code(), err.details())
        log.info("scheduler error", code=err.code().name, status=error.status, details=err.details())
        raise structured.renamed_error(error, constraint_field) from None
    except BaseException:
        generation.cancel()
        live.discard(generation)
        raise


@contextlib.asynccontextmanager
async def _cancel_on_disconnect(request: Request, cancel: Callable[[], None]) -> AsyncIterator[None]:
    """Call `cancel` if the client disconnects while the body is being prepared.

    Nothing else notices a disconnect before the response starts: the server
    does not cancel the handler, and the scheduler would keep generating (and
    holding blocks) for nobody. The request body is already read, so the next
    ASGI message is the disconnect.
    """

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


class _GenerationStream(StreamingResponse):
    """An event stream that cancels its Generate calls however it ends.

    A client that disconnects makes Starlette cancel the response; that can
    happen before the body generator ever started (so its own `finally` would
    not run), hence the cancel here, around the whole response.
    """

    def __init__(self, generation: Generation, events: AsyncIterator[str], ended: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._generation, self._ended = generation, ended

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._generation.cancel()  # a no-op on calls that finished
            self._ended()


def _sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _sse(
    generation: Generation,
    shape: ResponseShape,
    samples: list[Sample],
    include_usage: bool,
    prompt_tokens: dict[int, int] | None = None,
) -> AsyncIterator[str]:
    """The event stream: OpenAI chunks, an error event if the scheduler fails
    mid-stream (the 200 is already sent), then [DONE]. `prompt_tokens` (each prompt
    group's count): continuous usage stats, every chunk with its choice's usage so far."""
    async for event in guarded(_chunks(generation, shape, samples, include_usage, prompt_tokens), _sse_event):
        yield event
    yield "data: [DONE]\n\n"


async def _chunks(
    generation: Generation,
    shape: ResponseShape,
    samples: list[Sample],
    include_usage: bool,
    prompt_tokens: dict[int, int] | None,
) -> AsyncIterator[str]:
    results = Results(samples)

    def event(chunk: dict[str, Any]) -> str:
        if prompt_tokens is not None:
            chunk["usage"] = results.usage_so_far(chunk["choices"][0]["index"], prompt_tokens)
        return _sse_event(chunk)

    for start in shape.start_chunks([s.index for s in samples], include_usage):
        yield event(start)
    by_index = {s.index: s for s in samples}
    async for index, message in generation.events():
        delta = results.add(index, message)
        chunk = shape.chunk(by_index[index], message, delta, include_usage)
        if chunk is not None:
            yield event(chunk)
    if include_usage:
        yield _sse_event(shape.usage_chunk(results))
