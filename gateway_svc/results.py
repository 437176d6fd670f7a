"""serving.v1 responses into OpenAI's HTTP API: `GenerateResponse` messages become OpenAI
JSON bodies and stream chunks (`ResponseShape`), with `usage` summed over the choices and
logprobs in the completions' legacy and the chat shapes. Requests go the other way in
convert.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gateway_svc.chat_output import ChatOutput, ChatStream
from gateway_svc.convert import Sample
from proto import serving_pb2


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
