"""How every error leaves the gateway: as OpenAI error JSON with the matching HTTP status.

Exceptions raised by the routes (our OpenAIError, request validation, the scheduler's gRPC
status, a shutdown, a slow reader, an unknown route) are mapped here, once, for every
router the app mounts; the Anthropic routes' middleware reshapes the body for their paths.
"""

from __future__ import annotations

from typing import Any

import grpc
import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway_svc import errors
from gateway_svc.anthropic.errors import ANTHROPIC_PATHS, anthropic_error
from gateway_svc.errors import OpenAIError
from gateway_svc.generation import ClientGone, ShuttingDown, SlowReader

log = structlog.get_logger("gateway")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


def _error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, err: OpenAIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_to_openai(err))

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_error(_: Request, err: grpc.aio.AioRpcError) -> JSONResponse:
        mapped = errors.grpc_error(err.code(), err.details())
        log.info("scheduler error", code=err.code().name, status=mapped.status, details=err.details())
        return _error_response(mapped)

    @app.exception_handler(ShuttingDown)
    async def shutting_down(_: Request, err: ShuttingDown) -> JSONResponse:
        return _error_response(errors.shutting_down(str(err)))

    @app.exception_handler(SlowReader)
    async def slow_reader(_: Request, err: SlowReader) -> JSONResponse:
        return _error_response(errors.slow_reader(str(err)))

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # No route (404) or not this method (405): still OpenAI's shape, saying what was asked.
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        message = f"{err.detail}: {request.method} {request.url.path}"
        return JSONResponse(errors.error_body(message, type_), status_code=err.status_code, headers=err.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error", error=repr(err))
        body = errors.error_body("internal error", "internal_error")
        # Starlette answers this one outside every middleware: AnthropicErrors does not see it.
        if request.url.path.startswith(ANTHROPIC_PATHS):
            body = anthropic_error(body)
        return JSONResponse(body, status_code=500)


def _validation_to_openai(err: RequestValidationError) -> OpenAIError:
    """Pydantic's first error as one readable message; `param` is the field's dotted path."""
    first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return errors.bad_request(_json_error(first, err.body))
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
    return errors.bad_request(f"{param}: {message}" if param else message, param)


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
