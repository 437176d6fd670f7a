"""Request bodies, parsed and validated off the event loop when they are large.

FastAPI parses a declared body (json.loads, then the pydantic model) on the event
loop: a 5 MB chat body of 150,000 empty messages is a second or two of it, every
stream of the gateway stalled meanwhile. A route takes its body through
`JsonBody(Model)` instead: a body over PARSE_INLINE_BYTES is parsed in a worker
thread (pydantic-core and json release the loop between bytecodes and C calls), a
small one inline (a thread hop costs more than it saves). Errors are FastAPI's
own (RequestValidationError), so app.py answers them as before, and
`publish_openapi` documents the model as the route's request body.

A body nests at most MAX_NESTING arrays and objects deep: what the gateway and the
scheduler do with a JSON schema or a tool's parameters (grammar compilers, schema
walkers) recurses on that nesting, and a 100-level schema once crashed a compile.
The check walks the parsed body without recursing, and the 400 names the field.
"""

import asyncio
import email.message
import json
from typing import Any, ClassVar, Generic, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

PARSE_INLINE_BYTES = 65_536
MAX_NESTING = 64
REF_TEMPLATE = "#/components/schemas/{model}"

M = TypeVar("M", bound=BaseModel)


# No `from __future__ import annotations` here: FastAPI reads the annotations of a dependency
# object's __call__ at runtime, and without a module's globals a string names nothing.
class JsonBody(Generic[M]):
    """A FastAPI dependency: the request's JSON body as `model`. Every one made is kept in
    `made` (they are module constants), for the OpenAPI document's schemas."""

    made: ClassVar[list["JsonBody[Any]"]] = []

    def __init__(self, model: type[M]) -> None:
        self.model = model
        JsonBody.made.append(self)

    async def __call__(self, request: Request) -> M:
        raw = await request.body()
        is_json = _is_json(request.headers.get("content-type"))
        if len(raw) <= PARSE_INLINE_BYTES:
            return self.parse(raw, is_json)
        return await asyncio.to_thread(self.parse, raw, is_json)

    def parse(self, raw: bytes, is_json: bool) -> M:
        if not raw:
            missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
            raise RequestValidationError([missing])
        value: Any = raw
        if is_json:
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _json_invalid(exc.pos, exc.msg, raw) from None
            except (RecursionError, UnicodeDecodeError) as exc:
                why = "nested too deeply" if isinstance(exc, RecursionError) else "not UTF-8"
                raise _json_invalid(None, why, raw) from None
            _check_nesting(value)
        try:
            return self.model.model_validate(value)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors(include_url=False), body=raw) from None

    @property
    def openapi_extra(self) -> dict[str, Any]:
        """The route's requestBody in the OpenAPI document (publish_openapi adds the model's schema)."""
        schema = {"$ref": REF_TEMPLATE.format(model=self.model.__name__)}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: application/json or application/*+json; anything else is validated as bytes (a 400)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _check_nesting(body: Any) -> None:
    """A 400 naming the top-level field under which the body nests deeper than MAX_NESTING."""
    pending: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while pending:
        value, depth, field = pending.pop()
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_NESTING:
            where = field or "body"
            message = f"nests arrays and objects more than {MAX_NESTING} deep (this server's limit)"
            error = {"type": "value_error", "loc": (where,), "msg": message, "input": None}
            raise RequestValidationError([error])
        items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        for key, item in items:
            top = field if field is not None else (key if isinstance(key, str) else None)
            pending.append((item, depth + 1, top))


def _json_invalid(position: int | None, why: str, raw: bytes) -> RequestValidationError:
    loc = ("body",) if position is None else ("body", position)
    error = {"type": "json_invalid", "loc": loc, "msg": "JSON decode error", "input": {}, "ctx": {"error": why}}
    return RequestValidationError([error], body=raw)


def body_schemas() -> dict[str, Any]:
    """The components/schemas entries of the bodies' models (and the models they use)."""
    schemas: dict[str, Any] = {}
    for body in JsonBody.made:
        schema = body.model.model_json_schema(ref_template=REF_TEMPLATE, mode="validation")
        schemas.update(schema.pop("$defs", {}))
        schemas[body.model.__name__] = schema
    return schemas
