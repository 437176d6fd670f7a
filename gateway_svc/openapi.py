"""The gateway's OpenAPI document (`GET /openapi.json`), FastAPI's, saying what
the gateway really answers: errors are 400 (never FastAPI's 422) in OpenAI's
error shape, and a generation answers JSON or, with `stream: true`, an event
stream (text/event-stream) of `data: <chunk>` events ending in `data: [DONE]`."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway_svc.bodies import body_schemas

GATEWAY_VERSION = "0.1.0"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error("invalid request: `param` names the field"),
    401: _error("missing or wrong API key (--api-key)"),
    408: _error("the request body arrived too slowly (--body-timeout-s, --body-min-rate)"),
    413: _error("the request body is larger than --max-request-bytes"),
    404: _error("the model named in the request is not served here (code model_not_found)"),
    429: _error("the scheduler's queue is full"),
    503: _error("no scheduler or worker can take the request"),
    504: _error("the request ran past --request-timeout-s"),
}

GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "the answer: one JSON body, or with stream: true server-sent events",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {
                "schema": {"type": "string"},
                "example": 'data: {"object": "text_completion", "choices": [...]}\n\ndata: [DONE]\n\n',
            },
        },
    },
    **ERROR_RESPONSES,
}

HEALTH_RESPONSES: dict[int | str, dict[str, Any]] = {503: {"description": "the scheduler is down or not serving"}}


def publish_openapi(app: FastAPI) -> None:
    """Serve FastAPI's document with the gateway's real error status: request
    validation answers 400 (app.py maps it), so FastAPI's 422 entries go; and the
    request bodies the routes parse themselves (bodies.JsonBody) as their schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(body_schemas())
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
