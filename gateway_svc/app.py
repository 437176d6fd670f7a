"""The FastAPI app: OpenAI routes over a Scheduler (one, or a pool).

Routes parse and validate (openai_types), convert (convert), run the Generate
calls (generation) and answer as JSON or server-sent events. Every error leaves
as OpenAI error JSON with the matching HTTP status.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from gateway_svc import convert, structured
from gateway_svc.chat_output import ChatOutput
from gateway_svc.chat_template import ChatTemplate
from gateway_svc.config import GatewayConfig
from gateway_svc.convert import OpenAIError, ResponseShape, Sample
from gateway_svc.embeddings import embeddings_router
from gateway_svc.generation import ClientGone, Generation, LiveGenerations, ShuttingDown
from gateway_svc.limits import BodyLimit
from gateway_svc.metrics import SchedulerMetrics, install_metrics
from gateway_svc.openai_types import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway_svc.openapi import (
    ERROR_RESPONSES,
    GATEWAY_VERSION,
    GENERATION_RESPONSES,
    HEALTH_RESPONSES,
    publish_openapi,
)
from gateway_svc.scheduler_client import Scheduler
from gateway_svc.tokenize import max_model_len, tokenize_router

log = structlog.get_logger("gateway")

# Tell proxies not to buffer the event stream (each chunk must reach the client now).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def create_app(client: Scheduler, config: GatewayConfig) -> FastAPI:
    app = FastAPI(title="pagedserve gateway", version=GATEWAY_VERSION, docs_url=None, redoc_url=None)
    template = ChatTemplate.load(config.model_dir) if config.model_dir else None
    if config.model_dir and template is None:
        log.warning("no chat template: /v1/chat/completions will answer 400", model_dir=config.model_dir)
    started = int(time.time())
    require_key = _key_checker(config.api_key)
    served = _model_checker(config.model_id)
    parsers = structured.Parsers.load(config.tool_call_parser, config.reasoning_parser, config.model_dir)
    live = LiveGenerations()
    app.state.live = live  # the server drains them on shutdown (server.py)
    rules = convert.RequestRules(config.max_n, config.max_prompts, config.cache_salt_from_api_key)
    window = config.max_parallel_per_request

    @app.post("/v1/completions", dependencies=[Depends(require_key)], responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served(body.model)
        shape = ResponseShape("completion", config.model_id)
        constraint, field = structured.constraint_fields(body, parsers)
        samples = convert.completion_samples(body, shape.id, rules, _forwarded_key(request), constraint)
        return await _generate(client, live, request, body, shape, samples, window, field)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)], responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served(body.model)
        mode = body.tool_mode
        tools = [t.for_template() for t in body.tools or []] if mode != "none" else None
        prompt = await _render_chat(template, body, tools)
        constraint, field = structured.constraint_fields(body, parsers, prompt)
        reading = ChatOutput(parsers.reasoning, parsers.tool if mode != "none" else None, named=mode == "named")
        shape = ResponseShape("chat", config.model_id, reading)
        samples = convert.chat_samples(body, prompt, shape.id, rules, _forwarded_key(request), constraint)
        return await _generate(client, live, request, body, shape, samples, window, field)

    async def model_card(request: Request) -> dict[str, Any]:
        card = {"id": config.model_id, "object": "model", "created": started, "owned_by": "pagedserve"}
        return card | await max_model_len(client, _forwarded_key(request))

    @app.get("/v1/models", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": [await model_card(request)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_key)], responses=ERROR_RESPONSES)
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        if model_id != config.model_id:
            raise convert.model_not_found(model_id)
        return await model_card(request)

    @app.get("/health", responses=HEALTH_RESPONSES)
    async def health() -> JSONResponse:
        ok, why = await client.check_health(config.api_key or None)
        if ok:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": f"scheduler {client.target}: {why}"}, status_code=503)

    app.include_router(tokenize_router(client, template, _forwarded_key, served), dependencies=[Depends(require_key)])
    embeddings = embeddings_router(client, config.model_id, _forwarded_key, served, config.max_prompts)
    app.include_router(embeddings, dependencies=[Depends(require_key)])
    # An oversized body is refused before anything reads it (413), inside the metrics' count.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    install_metrics(app, SchedulerMetrics(config.scheduler_metrics, config.health_timeout_s))
    _add_error_handlers(app)
    publish_openapi(app)
    return app


# Messages longer than this (characters, all of them) are rendered in a worker thread:
# the template's Python code then shares the GIL in slices instead of holding the loop.
RENDER_INLINE_CHARS = 65_536


async def _render_chat(
    template: ChatTemplate | None, body: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> str:
    if sum(len(m.content or "") for m in body.messages) <= RENDER_INLINE_CHARS:
        return convert.chat_prompt(template, body.messages, body, tools)
    return await asyncio.to_thread(convert.chat_prompt, template, body.messages, body, tools)


def _model_checker(model_id: str) -> Callable[[str | None], None]:
    """One model per gateway: a request may leave `model` out or name it; another name is a 404."""

    def served(model: str | None) -> None:
        if model and model != model_id:
            raise convert.model_not_found(model)

    return served


# ---------------------------------------------------------------- auth


def _bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return key.strip()


def _key_checker(api_key: str) -> Callable[[Request], Awaitable[None]]:
    # async: FastAPI runs a plain `def` dependency in its thread pool, a thread
    # hand-off (and GIL round trip) on every request for a string compare.
    async def require_key(request: Request) -> None:
        if not api_key:
            return
        given = _bearer_key(request) or ""
        # Constant-time compare: the key must not leak through response timing.
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise OpenAIError(
                401,
                "missing or invalid API key (send 'Authorization: Bearer KEY')",
                "authentication_error",
                None,
                "invalid_api_key",
            )

    return require_key


def _forwarded_key(request: Request) -> str | None:
    """The caller's key, passed on so that a scheduler which wants one can check it."""
    key = _bearer_key(request)
    if key is not None and not (key.isascii() and key.isprintable()):
        raise OpenAIError(401, "API key must be printable ASCII", "authentication_error", None, "invalid_api_key")
    return key


# ---------------------------------------------------------------- generation


async def _generate(
    client: Scheduler,
    live: LiveGenerations,
    request: Request,
    body: SamplingFields,
    shape: ResponseShape,
    samples: list[Sample],
    window: int,
    constraint_field: str | None = None,
) -> Response:
    """`constraint_field`: the request field a structured-output constraint came from, named
    when the scheduler refuses the constraint."""
    generation = Generation(client, samples, _forwarded_key(request), window)
    live.add(generation)
    try:
        if body.stream:
            async with _cancel_on_disconnect(request, generation.cancel):
                await generation.start()
            stream = _sse(generation, shape, samples, body.include_usage)
            return _GenerationStream(generation, stream, lambda: live.discard(generation))
        results = convert.Results(samples)
        async with _cancel_on_disconnect(request, generation.cancel):
            async for index, message in generation.events():
                results.add(index, message)
        live.discard(generation)
        return JSONResponse(shape.body(results))
    except grpc.aio.AioRpcError as err:
        generation.cancel()
        live.discard(generation)
        error = convert.grpc_error(err.code(), err.details())
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
    generation: Generation, shape: ResponseShape, samples: list[Sample], include_usage: bool
) -> AsyncIterator[str]:
    """The event stream: OpenAI chunks, an error event if the scheduler fails
    mid-stream (the 200 is already sent), then [DONE]."""
    results = convert.Results(samples)
    try:
        for start in shape.start_chunks([s.index for s in samples], include_usage):
            yield _sse_event(start)
        by_index = {s.index: s for s in samples}
        async for index, message in generation.events():
            delta = results.add(index, message)
            chunk = shape.chunk(by_index[index], message, delta, include_usage)
            if chunk is not None:
                yield _sse_event(chunk)
        if include_usage:
            yield _sse_event(shape.usage_chunk(results))
    except grpc.aio.AioRpcError as err:
        # Headers are gone: the error travels as an event (the openai client raises it).
        yield _sse_event(convert.grpc_error(err.code(), err.details()).body())
    except ClientGone:
        return
    except ShuttingDown as exc:  # the drain timeout passed: end cleanly, the client knows why
        yield _sse_event(convert.shutting_down(str(exc)).body())
    except Exception as exc:  # a bug of ours: tell the client, keep the trace in our log
        log.exception("stream failed", error=repr(exc))
        yield _sse_event(convert.error_body("internal error", "internal_error"))
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- errors


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, err: OpenAIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_to_openai(err))

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_error(_: Request, err: grpc.aio.AioRpcError) -> JSONResponse:
        mapped = convert.grpc_error(err.code(), err.details())
        log.info("scheduler error", code=err.code().name, status=mapped.status, details=err.details())
        return _error_response(mapped)

    @app.exception_handler(ShuttingDown)
    async def shutting_down(_: Request, err: ShuttingDown) -> JSONResponse:
        return _error_response(convert.shutting_down(str(err)))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # No route (404) or not this method (405): still OpenAI's shape, saying what was asked.
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = f"{err.detail}: {request.method} {request.url.path}"
        return JSONResponse(convert.error_body(message, type_), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("internal error", error=repr(err))
        return JSONResponse(convert.error_body("internal error", "internal_error"), status_code=500)


def _validation_to_openai(err: RequestValidationError) -> OpenAIError:
    """Pydantic's first error as one readable message; `param` is the field's dotted path."""
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return convert.bad_request(_json_error(first, err.body))
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type name to the path (e.g. prompt.str); keep the field path only.
    loc = [
        p for p in loc if not any(ch in p for ch in "[]") and p not in ("str", "int", "list", "dict", "bool", "float")
    ]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        message = "unrecognized request argument (this server does not support it)"
    else:
        message = str(first.get("msg")).removeprefix("Value error, ")
    return convert.bad_request(f"{param}: {message}" if param else message, param)


def _json_error(error: Any, body: Any) -> str:
    """Where the body stops being JSON, as line, column and character, and why."""
    position = next((p for p in error.get("loc", ()) if isinstance(p, int)), None)
    why = error.get("ctx", {}).get("error", "not JSON")
    if position is None or not isinstance(body, str | bytes):
        return f"the request body is not valid JSON: {why}"
    text = body if isinstance(body, str) else body.decode(errors="replace")
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    return f"the request body is not valid JSON: {why} at line {line}, column {column} (character {position})"
