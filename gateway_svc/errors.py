"""Errors in OpenAI's shape ({"error": {message, type, param, code}} and an HTTP status),
and the one mapping from the scheduler's gRPC status codes to them."""

from __future__ import annotations

from typing import Any

import grpc

from gateway_svc.openai_types import ChatCompletionRequest, CompletionRequest


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def shutting_down(why: str) -> OpenAIError:
    return OpenAIError(503, why, "service_unavailable_error", None, "shutting_down")


def slow_reader(why: str) -> OpenAIError:
    return OpenAIError(503, why, "service_unavailable_error", None, "stream_buffer_full")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# gRPC status -> (HTTP status, OpenAI error type). Anything else is a 500.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),  # e.g. chat on a --runner pooling scheduler
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    # admin.v1 (the LoRA admin routes): vLLM answers an adapter loaded twice with a 400.
    grpc.StatusCode.ALREADY_EXISTS: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
}


# serving.v1 fields the scheduler names (its refusals read "FIELD: why") under another
# OpenAI name; the others the requests share (max_tokens, stop, ...) keep theirs.
_OPENAI_PARAM = {"prompt_token_ids": "prompt", "prompt_logprobs": "logprobs", "token_ids": "tokens"}
_REQUEST_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields) | {"tokens"}


def refused_param(details: str) -> str | None:
    """The request field a scheduler's refusal names, as the OpenAI request calls it."""
    field = details.split(":", 1)[0] if ":" in details else ""
    param = _OPENAI_PARAM.get(field, field)
    return param if param in _REQUEST_FIELDS else None


def grpc_error(code: grpc.StatusCode, details: str | None) -> OpenAIError:
    status, type_ = _GRPC_TO_HTTP.get(code, (500, "internal_error"))
    # The scheduler's messages are written for clients (never a stack trace): pass them on.
    message = details or f"scheduler returned {code.name}"
    param = refused_param(message) if status == 400 else None
    return OpenAIError(status, message, type_, param, code.name.lower())
