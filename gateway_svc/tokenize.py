"""vLLM's /tokenize and /detokenize, with the scheduler's tokenizer (serving.v1
Tokenize / Detokenize), and the scheduler's ModelInfo for /v1/models (max_model_len, weight format, adapters).

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                   or {model?, messages, add_generation_prompt=true, add_special_tokens=false, ...}
                   -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {model?, tokens} -> {prompt}

Messages are rendered with the model's chat template first, as for
/v1/chat/completions; the template writes the special tokens itself, hence
vLLM's default add_special_tokens=false for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from gateway_svc.bodies import JsonBody
from gateway_svc.chat_template import ChatTemplate
from gateway_svc.convert import chat_prompt
from gateway_svc.errors import bad_request
from gateway_svc.openai_fields import STRICT, Text, TokenId
from gateway_svc.openai_types import ChatMessage, ChatRendering
from gateway_svc.openapi import ERROR_RESPONSES
from gateway_svc.scheduler_client import Scheduler
from proto import serving_pb2

ForwardedKey = Callable[[Request], str | None]
ModelCheck = Callable[[str | None], None]


class TokenizeRequest(ChatRendering):
    # The published schema says what _text checks: exactly one of a non-empty prompt or messages.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string", "minLength": 1}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array", "minItems": 1}}},
            ]
        },
    )

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: list[TokenId]


# Module globals: the routes' annotations name them (a string annotation sees no locals).
TOKENIZE_BODY, DETOKENIZE_BODY = JsonBody(TokenizeRequest), JsonBody(DetokenizeRequest)


def tokenize_router(
    client: Scheduler, template: ChatTemplate | None, forwarded_key: ForwardedKey, served: ModelCheck
) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", responses=ERROR_RESPONSES, openapi_extra=TOKENIZE_BODY.openapi_extra)
    async def tokenize(body: Annotated[TokenizeRequest, Depends(TOKENIZE_BODY)], request: Request) -> dict[str, Any]:
        served(body.model)
        prompt, add_special_tokens = _text(body, template)
        reply = await client.tokenize(prompt, add_special_tokens, body.return_token_strs, forwarded_key(request))
        tokens = list(reply.token_ids)
        return {
            "count": len(tokens),
            "max_model_len": reply.max_model_len,
            "tokens": tokens,
            "token_strs": list(reply.token_strs) if body.return_token_strs else None,
        }

    @router.post("/detokenize", responses=ERROR_RESPONSES, openapi_extra=DETOKENIZE_BODY.openapi_extra)
    async def detokenize(
        body: Annotated[DetokenizeRequest, Depends(DETOKENIZE_BODY)], request: Request
    ) -> dict[str, str]:
        served(body.model)
        try:
            reply = await client.detokenize(body.tokens, forwarded_key(request))
        except grpc.aio.AioRpcError as err:
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:  # an id outside the vocabulary
                raise bad_request(f"tokens: {(err.details() or '').removeprefix('token_ids: ')}", "tokens") from err
            raise
        return {"prompt": reply.text}

    return router


def _text(body: TokenizeRequest, template: ChatTemplate | None) -> tuple[str, bool]:
    """The text to tokenize and whether to add the tokenizer's special tokens."""
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (text) and messages", "prompt")
    if body.prompt is not None:
        if not body.prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        return body.prompt, body.add_special_tokens is not False
    assert body.messages is not None
    if not body.messages:
        raise bad_request("messages: must not be empty", "messages")
    return chat_prompt(template, body.messages, body), body.add_special_tokens is True


# The scheduler refused the caller, not the question: /v1/models answers as Generate would (401/403).
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


async def model_info(client: Scheduler, api_key: str | None) -> serving_pb2.ModelInfoResponse | None:
    """The scheduler's ModelInfo, or None when it cannot say (down, or an older
    scheduler): /v1/models answers either way, but only to a caller the scheduler
    takes (its API keys)."""
    try:
        return await client.model_info(api_key)
    except grpc.aio.AioRpcError as err:
        if err.code() in _REFUSALS:
            raise
        return None
