"""A reasoning model's `<think>…</think>` text apart from its answer
(`--reasoning-parser`), as `reasoning_content` beside `content`.

  qwen3        the output opens its reasoning itself: `<think>` at the start (after
               whitespace) starts it; an output without it is all content (thinking off).
  deepseek_r1  the chat template opens `<think>` in the prompt: the output starts inside
               the reasoning (a `<think>` there is dropped) and `</think>` ends it;
               an output without `</think>` is all reasoning (cut off while thinking).

As for tool calls (tool_parsers.py), one incremental machine serves both
ways: `split(text)` feeds it the whole text, `stream()` feeds it deltas, so a
streamed answer reassembles to the non-streamed one. The tags are held back
while they may still be arriving. A structured-output grammar starts after
`end_tag` (scheduler_svc/structured: GrammarMatcher's `activate_after`)."""

from __future__ import annotations

from abc import ABC
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from gateway_svc.text_tags import held_prefix

START_TAG, END_TAG = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: no reasoning text
    content: str | None  # None: no answer text


class ReasoningStream:
    def __init__(self, starts_inside: bool) -> None:
        # "head": before the output shows whether it reasons; "reasoning"; "content"
        self._state = "head"
        self._starts_inside = starts_inside
        self._held = ""

    def feed(self, text: str) -> ReasoningDelta:
        text = self._held + text
        self._held = ""
        reasoning, content = [], []
        if self._state == "head":
            stripped = text.lstrip()
            if START_TAG.startswith(stripped) and stripped != START_TAG:
                self._held = text  # empty, or a `<think>` still arriving
                return ReasoningDelta()
            if stripped.startswith(START_TAG):
                self._state, text = "reasoning", stripped[len(START_TAG) :]
            else:
                self._state = "reasoning" if self._starts_inside else "content"
        if self._state == "reasoning":
            at = text.find(END_TAG)
            if at < 0:
                held = held_prefix(text, END_TAG)
                reasoning.append(text[: len(text) - held])
                self._held = text[len(text) - held :]
                text = ""
            else:
                reasoning.append(text[:at])
                self._state, text = "content", text[at + len(END_TAG) :]
        if self._state == "content":
            content.append(text)
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        if self._state == "reasoning" or (self._state == "head" and self._starts_inside):
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)


class ReasoningParser(ABC):
    name: ClassVar[str]
    starts_inside: ClassVar[bool]
    end_tag: ClassVar[str] = END_TAG

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)

    def split(self, text: str) -> ReasoningSplit:
        stream = self.stream()
        return join([stream.feed(text), stream.finish()])


def join(deltas: Sequence[ReasoningDelta]) -> ReasoningSplit:
    """The non-streamed split from stream deltas (what a client does with a stream)."""
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return ReasoningSplit(reasoning or None, content or None)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_inside = False


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_inside = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser `--reasoning-parser NAME` selects; ValueError naming the choices for another name."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {sorted(REASONING_PARSERS)}") from None
