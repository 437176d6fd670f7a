"""The one place that converts between OpenAI's HTTP API and serving.v1.

* requests: an OpenAI body becomes one `GenerateRequest` per choice (n samples
  of each prompt of the batch), each a `Sample` with its choice index;
* responses: serving.v1 `GenerateResponse` messages become OpenAI JSON bodies
  and stream chunks (`ResponseShape`), with `usage` summed over the choices;
* errors: gRPC status codes become OpenAI error JSON and an HTTP status.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from gateway_svc.config import INT32_MAX
from gateway_svc.openai_types import UINT64_MAX, ChatCompletionRequest, CompletionRequest, SamplingFields
from proto import serving_pb2


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, "invalid_value" if param else None)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---------------------------------------------------------------- requests


@dataclass(frozen=True)
class Sample:
    """One Generate call: the choice `index` it answers and the prompt (`group`) it samples."""

    index: int
    group: int
    request: serving_pb2.GenerateRequest


def completion_samples(body: CompletionRequest, response_id: str, max_n: int) -> list[Sample]:
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (this server returns every sample)", "best_of")
    prompts = [{"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts]
    return _samples(prompts, body, body.max_tokens, response_id, max_n)


def chat_samples(
    body: ChatCompletionRequest, prompt: str, response_id: str, max_n: int, default_max_tokens: int = 0
) -> list[Sample]:
    """`default_max_tokens` applies when the body sets no limit; 0 = up to the model's context.

    OpenAI's chat API has no default output limit (an answer ends at its end or
    at the context length), and a chat answer cut at the scheduler's default of
    16 tokens is rarely what a caller wants. The scheduler stops a request when
    prompt + output reach its max_model_len (finish_reason "length") and accepts
    a larger max_tokens, so "no limit" is the largest max_tokens serving.v1 takes.
    """
    max_tokens = body.output_limit
    if max_tokens is None:
        max_tokens = default_max_tokens or INT32_MAX
    return _samples([{"prompt": prompt}], body, max_tokens, response_id, max_n)


def _samples(
    prompts: list[dict], body: SamplingFields, max_tokens: int | None, response_id: str, max_n: int
) -> list[Sample]:
    if body.n > max_n:
        raise bad_request(f"n must be <= {max_n}", "n")
    # serving.v1's max_tokens and top_k are int32: a larger value means the same as
    # INT32_MAX there (the context length and the vocabulary are both far smaller).
    params = {
        "max_tokens": _int32(max_tokens),
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": _int32(body.top_k),
        "stop": body.stop_list,
        "ignore_eos": body.ignore_eos,
    }
    params = {k: v for k, v in params.items() if v is not None}  # unset = the scheduler's default
    samples = []
    for group, prompt in enumerate(prompts):
        for i in range(body.n):
            index = group * body.n + i
            request = serving_pb2.GenerateRequest(request_id=f"{response_id}-{index}", **prompt, **params)
            if body.seed is not None:
                # Sample i of a seeded request gets seed+i: reproducible, yet the n choices differ;
                # sample 0 matches the same request sent with n=1.
                request.seed = (body.seed + i) & UINT64_MAX
            samples.append(Sample(index, group, request))
    return samples


def _int32(value: int | None) -> int | None:
    return None if value is None else min(value, INT32_MAX)


# ---------------------------------------------------------------- responses


def finish_reason(message: serving_pb2.GenerateResponse) -> str | None:
    """serving.v1 says stop | length | abort; OpenAI knows stop and length (others pass through)."""
    if not message.finished:
        return None
    return message.finish_reason or "stop"


@dataclass
class ChoiceResult:
    group: int
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: serving_pb2.Usage | None = None


class Results:
    """Accumulates the messages of every sample of one HTTP request."""

    def __init__(self, samples: list[Sample]):
        self.choices = {s.index: ChoiceResult(s.group) for s in samples}

    def add(self, index: int, message: serving_pb2.GenerateResponse) -> None:
        choice = self.choices[index]
        if message.text:
            choice.text.append(message.text)
        if message.finished:
            choice.finish_reason = finish_reason(message)
        if message.HasField("usage"):
            choice.usage = message.usage

    def usage(self) -> dict[str, Any]:
        """OpenAI counts each prompt once and every sample's output."""
        by_group: dict[int, list[serving_pb2.Usage]] = {}
        for choice in self.choices.values():
            by_group.setdefault(choice.group, []).append(choice.usage or serving_pb2.Usage())
        prompt = sum(max(u.prompt_tokens for u in us) for us in by_group.values())
        # Samples of one prompt run concurrently and may see different cache hits: report
        # what every one of them found cached.
        cached = sum(min(u.cached_prompt_tokens for u in us) for us in by_group.values())
        completion = sum(u.completion_tokens for us in by_group.values() for u in us)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


class ResponseShape:
    """OpenAI JSON for one response: `kind` is "completion" (/v1/completions) or "chat"."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], usage: Any = ...) -> dict[str, Any]:
        # usage: ... = no "usage" key at all; None = "usage": null (include_usage chunks).
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not ...:
            body["usage"] = usage
        return body

    def body(self, results: Results) -> dict[str, Any]:
        """The non-streaming response."""
        choices = []
        for index in sorted(results.choices):
            c = results.choices[index]
            text = "".join(c.text)
            content = {"message": {"role": "assistant", "content": text}} if self.kind == "chat" else {"text": text}
            choices.append({"index": index, **content, "logprobs": None, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, results.usage())

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def start_chunks(self, indices: list[int], include_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open each choice with its role, as OpenAI does."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None, include_usage) for i in indices]

    def chunk(self, index: int, message: serving_pb2.GenerateResponse, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for one serving.v1 message; None for progress-only messages."""
        reason = finish_reason(message)
        if not message.text and reason is None:
            return None
        if self.kind == "chat":
            content = {"delta": {"content": message.text} if message.text else {}}
        else:
            content = {"text": message.text}
        return self._chunk(index, content, reason, include_usage)

    def _chunk(self, index: int, content: dict, reason: str | None, include_usage: bool) -> dict[str, Any]:
        choice = {"index": index, **content, "logprobs": None, "finish_reason": reason}
        # With stream_options.include_usage every chunk carries "usage": null but the last.
        return self._envelope(self.chunk_object, [choice], None if include_usage else ...)

    def usage_chunk(self, results: Results) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], results.usage())


# ---------------------------------------------------------------- errors

# gRPC status -> (HTTP status, OpenAI error type). Anything else is a 500.
_GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def grpc_error(code: grpc.StatusCode, details: str | None) -> OpenAIError:
    status, type_ = _GRPC_TO_HTTP.get(code, (500, "internal_error"))
    # The scheduler's messages are written for clients (never a stack trace): pass them on.
    message = details or f"scheduler returned {code.name}"
    return OpenAIError(status, message, type_, None, code.name.lower())
