"""OpenAI's HTTP requests into serving.v1: an OpenAI body becomes one `GenerateRequest`
per choice (n samples of each prompt of the batch), each a `Sample` with its choice
index. The way back (serving.v1 responses into OpenAI bodies) is results.py; errors in
OpenAI's shape, and from gRPC status codes, are in errors.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from gateway_svc.chat_template import ChatTemplate, ChatTemplateError
from gateway_svc.errors import bad_request
from gateway_svc.openai_fields import UINT64_MAX
from gateway_svc.openai_types import (
    ChatCompletionRequest,
    ChatMessage,
    ChatRendering,
    CompletionRequest,
    SamplingFields,
)
from proto import serving_pb2

# /v1/completions' max_tokens when the body leaves it unset (OpenAI's and vLLM's default there).
COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestRules:
    """What the operator set for every request (GatewayConfig)."""

    max_n: int = 16
    max_prompts: int = 1024  # prompts of one /v1/completions batch
    cache_salt_from_api_key: bool = False  # each API key its own prefix cache (tenant_salt)
    base_model: str = ""  # a request naming another (served) model runs through that LoRA adapter
    chat_default_max_tokens: int = 0  # a chat's output when it sets no limit, at most (0: up to the context)


def tenant_salt(api_key: str | None, cache_salt: str | None) -> str | None:
    """The cache salt of a caller known by `api_key`: a digest of the key, then the
    request's own salt. Two keys never share a cached block, and no salt a caller can
    choose reaches into another key's (every one of them starts with the caller's digest)."""
    if api_key is None:
        return cache_salt
    digest = hashlib.sha256(b"pagedserve-tenant\0" + api_key.encode()).hexdigest()[:32]
    return f"key:{digest}" + (f"/{cache_salt}" if cache_salt else "")


@dataclass(frozen=True)
class Sample:
    """One Generate call: the choice `index` it answers and the prompt (`group`) it samples."""

    index: int
    group: int
    request: serving_pb2.GenerateRequest
    logprobs: bool = False  # answer with a logprobs object
    echo: bool = False  # completions: the prompt's text (and logprobs) come before the completion's
    prompt_text: str | None = None  # the prompt as sent; None for token ids (their texts are echoed)


def completion_samples(
    body: CompletionRequest,
    response_id: str,
    rules: RequestRules,
    api_key: str | None = None,
    constraint: dict[str, Any] | None = None,
) -> list[Sample]:
    """`constraint`: serving.v1's structured_output fields (gateway_svc/structured.py)."""
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (this server returns every sample)", "best_of")
    limit = body.output_limit
    if limit == 0 and not body.echo:
        field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        raise bad_request(f"{field} must be >= 1 (0 only with echo: the prompt is scored, nothing generated)", field)
    if len(body.prompts) > rules.max_prompts:
        raise bad_request(f"at most {rules.max_prompts} prompts per request, got {len(body.prompts)}", "prompt")
    prompts: list[dict[str, Any]] = [
        {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p} for p in body.prompts
    ]
    if body.echo:
        # The prompt's logprobs, and for token ids its tokens' texts; and max_tokens 0 needs them.
        for prompt in prompts:
            if body.logprobs is not None or limit == 0 or "prompt_token_ids" in prompt:
                prompt["prompt_logprobs"] = body.logprobs or 0
    max_tokens = COMPLETION_MAX_TOKENS if limit is None else limit
    samples = _samples(prompts, body, max_tokens, response_id, rules, body.logprobs, api_key, constraint)
    texts = [p if isinstance(p, str) else None for p in body.prompts]
    return [
        dataclasses.replace(s, logprobs=body.logprobs is not None, echo=body.echo, prompt_text=texts[s.group])
        for s in samples
    ]


def chat_body(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's request (responses, messages) runs as; what chat refuses
    in it (an empty tool call id, ...) is a 400 naming the chat field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"{where}: {str(first['msg']).removeprefix('Value error, ')}", where) from None


def chat_prompt(
    template: ChatTemplate | None,
    messages: list[ChatMessage],
    rendering: ChatRendering,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The messages rendered by the model's chat template, as the prompt text; `tools` as the
    template's `tools` (HF's apply_chat_template(tools=...))."""
    if template is None:
        raise bad_request("this model has no chat template: use /v1/completions (or tokenize a prompt)", "messages")
    if rendering.add_generation_prompt and rendering.continue_final_message:
        raise bad_request(
            "continue_final_message needs add_generation_prompt: false (the reply cannot both start and go on)",
            "continue_final_message",
        )
    if rendering.continue_final_message and messages[-1].role != "assistant":
        raise bad_request("continue_final_message: the last message must be the assistant's", "continue_final_message")
    try:
        turns = [m.for_template() for m in messages]
        variables = {**(rendering.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        return template.render(turns, rendering.add_generation_prompt, rendering.continue_final_message, variables)
    except (ChatTemplateError, ValueError) as exc:  # ValueError: a tool call's arguments are not JSON
        raise bad_request(str(exc), "messages") from exc


def chat_samples(
    body: ChatCompletionRequest,
    prompt: str,
    response_id: str,
    rules: RequestRules,
    api_key: str | None = None,
    constraint: dict[str, Any] | None = None,
) -> list[Sample]:
    """Without max_tokens / max_completion_tokens the answer may run up to the
    model's context (serving.v1's unset max_tokens), as OpenAI's chat API does,
    within the gateway's --default-max-tokens (and the scheduler's) when set."""
    if body.top_logprobs and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompts: list[dict[str, Any]] = [{"prompt": _utf8_prompt(prompt)}]
    if body.output_limit is None and rules.chat_default_max_tokens:
        prompts[0]["default_max_tokens"] = rules.chat_default_max_tokens
    samples = _samples(prompts, body, body.output_limit, response_id, rules, logprobs, api_key, constraint)
    return [dataclasses.replace(s, logprobs=body.logprobs) for s in samples]


def _utf8_prompt(prompt: str) -> str:
    """A rendered prompt is sent as serving.v1 text: chat_template_kwargs could put a lone surrogate in it."""
    try:
        prompt.encode()
    except UnicodeEncodeError:
        raise bad_request("the rendered prompt is not valid UTF-8 text", "messages") from None
    return prompt


def _samples(
    prompts: list[dict[str, Any]],
    body: SamplingFields,
    max_tokens: int | None,
    response_id: str,
    rules: RequestRules,
    logprobs: int | None,
    api_key: str | None,
    constraint: dict[str, Any] | None = None,
) -> list[Sample]:
    if body.n > rules.max_n:
        raise bad_request(f"n must be <= {rules.max_n}", "n")
    salt = tenant_salt(api_key, body.cache_salt) if rules.cache_salt_from_api_key else body.cache_salt
    # Every value is in serving.v1's range already (openai_types.py checked them).
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k_or_none,
        "min_p": body.min_p,
        "stop": body.stop_list,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "logit_bias": body.logit_bias_ids,
        "min_tokens": body.min_tokens,
        "stop_token_ids": body.stop_token_ids,
        "cache_salt": salt,
        "priority": body.priority,
        "no_speculation": body.no_speculation,
        "lora_adapter": body.model if rules.base_model and body.model not in (None, rules.base_model) else None,
    }
    params = {k: v for k, v in params.items() if v is not None}  # unset = the scheduler's default
    samples = []
    for group, prompt in enumerate(prompts):
        for i in range(body.n):
            index = group * body.n + i
            request = serving_pb2.GenerateRequest(
                request_id=f"{response_id}-{index}", **prompt, **params, **(constraint or {})
            )
            if body.seed is not None:
                # Sample i of a seeded request gets seed+i: reproducible, yet the n choices differ;
                # sample 0 matches the same request sent with n=1.
                request.seed = (body.seed + i) & UINT64_MAX
            samples.append(Sample(index, group, request))
    return samples
