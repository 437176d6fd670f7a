"""The one place that converts between OpenAI's HTTP API and serving.v1.

* requests: an OpenAI body becomes one `GenerateRequest` per choice (n samples
  of each prompt of the batch), each a `Sample` with its choice index;
* responses: serving.v1 `GenerateResponse` messages become OpenAI JSON bodies
  and stream chunks (`ResponseShape`), with `usage` summed over the choices.

Errors in OpenAI's shape, and from gRPC status codes, are in errors.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway_svc.chat_output import ChatOutput, ChatStream
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


# ---------------------------------------------------------------- requests


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


# ---------------------------------------------------------------- responses


def finish_reason(message: serving_pb2.GenerateResponse) -> str | None:
    """serving.v1 says stop | length | abort; OpenAI knows stop and length (others pass through)."""
    if not message.finished:
        return None
    return message.finish_reason or "stop"


# JSON has no -inf: a logprob that underflows is reported as this (as vLLM does).
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float | None  # None: the first prompt token
    top: list[tuple[str, float]]  # the most likely tokens at this position, most likely first


def _entries(tokens: Iterable[serving_pb2.TokenLogprob]) -> list[LogprobEntry]:
    return [
        LogprobEntry(
            t.token,
            max(t.logprob, MIN_LOGPROB) if t.HasField("logprob") else None,
            [(a.token, max(a.logprob, MIN_LOGPROB)) for a in t.top],
        )
        for t in tokens
    ]


@dataclass(frozen=True)
class Delta:
    """What one serving.v1 message adds to a choice."""

    text: str
    entries: list[LogprobEntry]
    offsets: list[int]  # each entry's text offset in the choice's text


@dataclass
class ChoiceResult:
    sample: Sample
    text: list[str] = field(default_factory=list)
    entries: list[LogprobEntry] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it (Anthropic's stop_sequence)
    usage: serving_pb2.Usage | None = None
    completion_tokens: int = 0  # so far (continuous usage stats)
    echoed: bool = False
    _next_offset: int = 0

    @property
    def group(self) -> int:
        return self.sample.group

    def add(self, message: serving_pb2.GenerateResponse) -> Delta:
        text, entries = message.text, _entries(message.token_logprobs)
        self.completion_tokens += len(message.token_ids)
        if self.sample.echo and not self.echoed and (message.token_ids or message.finished):
            # The first message with output (or the end): the prompt logprobs are on it.
            self.echoed = True
            prompt = _entries(message.prompt_logprobs)
            echo = self.sample.prompt_text
            text = ("".join(e.token for e in prompt) if echo is None else echo) + text
            entries = prompt + entries
        offsets = []
        for entry in entries:
            offsets.append(self._next_offset)
            self._next_offset += len(entry.token)
        if text:
            self.text.append(text)
        self.entries += entries
        self.offsets += offsets
        if message.finished:
            self.finish_reason = finish_reason(message)
            self.stop_string = message.stop_string if message.HasField("stop_string") else None
        if message.HasField("usage"):
            self.usage = message.usage
        return Delta(text, entries, offsets)


class Results:
    """Accumulates the messages of every sample of one HTTP request."""

    def __init__(self, samples: list[Sample]):
        self.choices = {s.index: ChoiceResult(s) for s in samples}

    def add(self, index: int, message: serving_pb2.GenerateResponse) -> Delta:
        return self.choices[index].add(message)

    def usage_so_far(self, index: int, prompt_tokens: dict[int, int]) -> dict[str, int]:
        """vLLM's continuous usage stats: one choice's counts at this point of its stream
        (`prompt_tokens`: each prompt group's count)."""
        choice = self.choices[index]
        prompt = prompt_tokens[choice.group]
        done = choice.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

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
    """OpenAI JSON for one response: `kind` is "completion" (/v1/completions) or "chat";
    `chat`: how a chat choice's text reads (reasoning, tool calls; chat_output.py)."""

    def __init__(self, kind: str, model: str, chat: ChatOutput | None = None):
        self.kind, self.model = kind, model
        self.chat = chat or ChatOutput()
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._streams: dict[int, ChatStream] = {}  # a streamed chat choice's parsers, by index

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
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
            text, reason = "".join(c.text), c.finish_reason
            content: dict[str, Any]
            if self.kind == "chat":
                message, called = self.chat.message(text, reason)
                content, reason = {"message": message}, self.chat.finish_reason(reason, called)
            else:
                content = {"text": text}
            logprobs = self._logprobs(c.sample, c.entries, c.offsets)
            choices.append({"index": index, **content, "logprobs": logprobs, "finish_reason": reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, choices, results.usage())

    def _logprobs(self, sample: Sample, entries: list[LogprobEntry], offsets: list[int]) -> dict[str, Any] | None:
        if not sample.logprobs:
            return None
        return chat_logprobs(entries) if self.kind == "chat" else completion_logprobs(entries, offsets)

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def start_chunks(self, indices: list[int], include_usage: bool) -> list[dict[str, Any]]:
        """Chat streams open each choice with its role, as OpenAI does."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"delta": {"role": "assistant", "content": ""}}, None, include_usage) for i in indices]

    def chunk(
        self, sample: Sample, message: serving_pb2.GenerateResponse, delta: Delta, include_usage: bool
    ) -> dict[str, Any] | None:
        """The stream chunk for one serving.v1 message (`delta`: what it added); None
        for progress-only messages."""
        reason = finish_reason(message)
        content: dict[str, Any]
        if self.kind == "chat":
            stream = self._streams.setdefault(sample.index, self.chat.stream())
            said = stream.feed(delta.text)
            if reason is not None:
                said = _joined(said, stream.finish(reason))
                reason = self.chat.finish_reason(reason, stream.called)
            if not said and not delta.entries and reason is None:
                return None  # progress only, or text the parsers hold back for now
            content = {"delta": said}
        else:
            if not delta.text and not delta.entries and reason is None:
                return None
            content = {"text": delta.text}
        logprobs = self._logprobs(sample, delta.entries, delta.offsets)
        return self._chunk(sample.index, content, reason, include_usage, logprobs)

    def _chunk(
        self,
        index: int,
        content: dict[str, Any],
        reason: str | None,
        include_usage: bool,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, **content, "logprobs": logprobs, "finish_reason": reason}
        # With stream_options.include_usage every chunk carries "usage": null but the last.
        return self._envelope(self.chunk_object, [choice], None if include_usage else ...)

    def usage_chunk(self, results: Results) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], results.usage())


def _joined(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two chat deltas as one: texts end to end, tool-call pieces one after the other."""
    joined = dict(first)
    for key, value in then.items():
        joined[key] = joined[key] + value if key in joined else value
    return joined


def completion_logprobs(entries: list[LogprobEntry], offsets: list[int]) -> dict[str, Any]:
    """/v1/completions' (legacy) shape. Each position's top_logprobs holds the most
    likely tokens and the chosen one (so up to logprobs + 1 entries, as OpenAI says);
    the first prompt token of an echo has null logprob and top_logprobs."""
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [None if e.logprob is None else _top_dict(e) for e in entries],
        "text_offset": offsets,
    }


def _top_dict(entry: LogprobEntry) -> dict[str, float | None]:
    """Token text -> logprob. Texts can repeat (byte pieces of a character all read
    U+FFFD): the most likely token keeps the key, and the chosen token is there too."""
    top: dict[str, float | None] = {}
    for token, logprob in [*entry.top, (entry.token, entry.logprob)]:
        top.setdefault(token, logprob)
    return top


def chat_logprobs(entries: list[LogprobEntry]) -> dict[str, Any]:
    """/v1/chat/completions' shape: content[{token, logprob, bytes, top_logprobs}]."""

    def token(text: str, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [{**token(e.token, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top]} for e in entries]
    }
