"""Tool calls in a model's text, as OpenAI returns them (`--tool-call-parser`).

Each parser knows one model family's tool-call format:
  hermes       Hermes / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
               any number of them, text around them is content.
  llama3_json  Llama 3.1-3.3 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}`,
               optionally after `<|python_tag|>`, several separated by `;`.

One incremental state machine per format does all the work: `stream()` feeds it
text deltas and gets OpenAI-shaped deltas (a call's id and name first, then its
arguments as raw JSON text in pieces), and `parse()` is the same machine fed
the whole text at once, so a streamed answer reassembles to exactly the
non-streamed one. The arguments are the model's own JSON text, not re-encoded.

`grammar(tools, choice)` gives the Lark grammar (llguidance's dialect, with
%json for each function's parameters) that forces `tool_choice: required` or
a named function into this format, so the output always parses; at most
MAX_PARALLEL_CALLS calls, so that a model repeating calls still ends.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gateway_svc.json_scan import CallBodyScanner
from gateway_svc.text_tags import held_prefix

IdMaker = Callable[[], str]
# The most calls one forced answer may hold (parser's grammar or forced_tools' schema): a bound
# a model repeating calls runs into, so it ends.
MAX_PARALLEL_CALLS = 8


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolSpec:
    """One function of the request's `tools`."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text as the model wrote it


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output was only tool calls
    tool_calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class ToolCallDelta:
    """OpenAI's `choices[].delta.tool_calls[]` entry: id and name on a call's first delta only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class StreamDelta:
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolStream(ABC):
    """Incremental parser of one choice's text."""

    def __init__(self, make_id: IdMaker) -> None:
        self._make_id = make_id
        self._content: list[str] = []
        self._calls: list[ToolCallDelta] = []
        self._call: CallBodyScanner | None = None
        self._index = -1

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """Take the next piece of text; what can be said about it so far."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The text has ended: say what was held back."""

    # -- the delta being built --------------------------------------------------
    def _say(self, content: str) -> None:
        if content:
            self._content.append(content)

    def _start_call(self) -> None:
        self._call = CallBodyScanner()

    def _feed_call(self, text: str) -> int:
        """Feed the call body; returns how much of `text` it took (it stops at the body's end)."""
        assert self._call is not None
        taken = self._call.feed(text)
        self._drain_call()
        return taken

    def _drain_call(self) -> None:
        call = self._call
        assert call is not None
        if call.name is not None and not call.announced:
            call.announced = True
            self._index += 1
            self._calls.append(ToolCallDelta(self._index, self._make_id(), call.name))
        if call.announced:
            arguments = call.take_arguments()
            if arguments:
                self._calls.append(ToolCallDelta(self._index, arguments=arguments))

    def _flush(self) -> StreamDelta:
        delta = StreamDelta("".join(self._content), _merge(self._calls))
        self._content, self._calls = [], []
        return delta


class ToolParser(ABC):
    name: ClassVar[str]
    stream_type: ClassVar[type[ToolStream]]
    arguments_key: ClassVar[str]  # the body's key for the arguments, as the format writes it
    # Text the chat template of a model using this format writes (checked at start-up).
    template_marker: ClassVar[str]

    def __init__(self, make_id: IdMaker = new_call_id) -> None:
        self._make_id = make_id

    @abstractmethod
    def _calls_grammar(self, call_rule: str, parallel: bool) -> str:
        """Lark `start` for one call (or one or more with `parallel`) of rule `call_rule`."""

    def stream(self) -> ToolStream:
        return self.stream_type(self._make_id)

    def parse(self, text: str) -> ParsedOutput:
        stream = self.stream()
        return assemble([stream.feed(text), stream.finish()])

    def grammar(self, tools: Sequence[ToolSpec], parallel: bool = True) -> str:
        """Lark forcing the output to be tool calls of `tools` (tool_choice `required`;
        a named function: one tool, parallel=False)."""
        assert tools, "a tool-call grammar needs at least one tool"
        rules = [f"fn_{i}: {_body_schema(tool, self.arguments_key)}" for i, tool in enumerate(tools)]
        call = "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))
        return "\n".join([self._calls_grammar("call", parallel), call, *rules]) + "\n"


def assemble(deltas: Sequence[StreamDelta]) -> ParsedOutput:
    """Join stream deltas into the non-streamed answer (what a client does with a stream)."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    heads: dict[int, tuple[str, str]] = {}
    for delta in deltas:
        for call in delta.tool_calls:
            if call.id is not None and call.name is not None:
                heads[call.index] = (call.id, call.name)
            calls.setdefault(call.index, []).append(call.arguments)
    tool_calls = tuple(ToolCall(*heads[i], "".join(calls[i])) for i in sorted(calls))
    return ParsedOutput(content if content or not tool_calls else None, tool_calls)


def _more_calls(separator: str, one: str) -> str:
    """Up to MAX_PARALLEL_CALLS - 1 more calls after the first, each after `separator`."""
    more = ""
    for _ in range(MAX_PARALLEL_CALLS - 1):
        more = f"({separator} {one}{more})?"
    return " " + more


def _merge(calls: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Adjacent argument pieces of one call in one delta become one piece."""
    merged: list[ToolCallDelta] = []
    for call in calls:
        last = merged[-1] if merged else None
        if last is not None and last.index == call.index and call.id is None:
            merged[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + call.arguments)
        else:
            merged.append(call)
    return tuple(merged)


def _body_schema(tool: ToolSpec, arguments_key: str) -> str:
    schema = {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        # json.dumps' spacing, as the engine's JSON constraints (scheduler_svc/structured/compiler.py)
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
    }
    return "%json " + json.dumps(schema, ensure_ascii=False)


# ---- hermes ---------------------------------------------------------------------


class HermesStream(ToolStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, make_id: IdMaker) -> None:
        super().__init__(make_id)
        self._pending = ""  # text not yet said: a possible tag start, or whitespace after a call
        self._in_call = False
        self._seen_call = False

    def feed(self, text: str) -> StreamDelta:
        text = self._pending + text
        self._pending = ""
        while text:
            text = self._in_call_step(text) if self._in_call else self._outside_step(text)
        return self._flush()

    def finish(self) -> StreamDelta:
        if self._in_call:
            self._end_call()  # cut off inside a call (max_tokens): keep what it has
        elif not (self._seen_call and not self._pending.strip()):
            self._say(self._pending)
        self._pending = ""
        return self._flush()

    def _outside_step(self, text: str) -> str:
        at = text.find(self.START)
        if at < 0:
            held = held_prefix(text, self.START)
            self._say_outside(text[: len(text) - held])
            self._pending += text[len(text) - held :]
            return ""
        self._say_outside(text[:at], before_call=True)
        self._in_call, self._seen_call = True, True
        self._start_call()
        self._call_text: list[str] = [self.START]
        return text[at + len(self.START) :]

    def _say_outside(self, text: str, before_call: bool = False) -> None:
        # Whitespace between and after calls is the format's, not content.
        if self._seen_call and not text.strip():
            if not before_call:
                self._pending = text
            return
        self._say(text)

    def _in_call_step(self, text: str) -> str:
        call = self._call
        assert call is not None
        if not call.done:
            taken = self._feed_call(text)
            self._call_text.append(text[:taken])
            text = text[taken:]
            if not call.done:
                return ""
        at = text.find(self.END)
        if at < 0:
            held = held_prefix(text, self.END)
            self._call_text.append(text[: len(text) - held])
            self._pending = text[len(text) - held :]
            return ""
        self._call_text.append(text[: at + len(self.END)])
        self._end_call()
        return text[at + len(self.END) :]

    def _end_call(self) -> None:
        call = self._call
        assert call is not None
        if not call.announced:  # no name: it was not a tool call after all
            self._say("".join(self._call_text) + self._pending)
        self._in_call, self._call, self._pending = False, None, ""


class HermesParser(ToolParser):
    name = "hermes"
    stream_type = HermesStream
    arguments_key = "arguments"
    template_marker = "<tool_call>"

    def _calls_grammar(self, call_rule: str, parallel: bool) -> str:
        one = f'"<tool_call>\\n" {call_rule} "\\n</tool_call>"'
        return f"start: {one}" + (_more_calls('"\\n"', one) if parallel else "")


# ---- llama3_json ----------------------------------------------------------------


class Llama3JsonStream(ToolStream):
    PYTHON_TAG = "<|python_tag|>"
    SEPARATOR = ";"

    def __init__(self, make_id: IdMaker) -> None:
        super().__init__(make_id)
        self._head = ""  # the start of the output, until it shows whether it is tool calls
        self._mode: str | None = None  # "content" or "calls"
        self._after = ""  # text after a call, before the next one starts

    def feed(self, text: str) -> StreamDelta:
        if self._mode is None:
            self._head += text
            stripped = self._head.lstrip()
            if not stripped or (self.PYTHON_TAG.startswith(stripped) and stripped != self.PYTHON_TAG):
                return self._flush()  # undecided yet
            if stripped.startswith(self.PYTHON_TAG):
                self._mode, text = "calls", stripped[len(self.PYTHON_TAG) :]
            elif stripped.startswith("{"):
                self._mode, text = "calls", stripped
            else:
                self._mode, text = "content", self._head
        if self._mode == "content":
            self._say(text)
        else:
            self._calls_step(text)
        return self._flush()

    def finish(self) -> StreamDelta:
        if self._mode is None:
            self._say(self._head)
        elif self._mode == "calls":
            if self._call is not None and not self._call.announced:
                self._say(self._call.text)
            if self._after.strip(" \n\t" + self.SEPARATOR):
                self._say(self._after)
        return self._flush()

    def _calls_step(self, text: str) -> None:
        while text:
            if self._call is not None and not self._call.done:
                taken = self._feed_call(text)
                text = text[taken:]
                continue
            self._after += text
            text = ""
            rest = self._after.lstrip(" \n\t" + self.SEPARATOR)
            if rest.startswith("{"):
                self._after, text = "", rest
                self._start_call()
            elif rest:
                self._mode = "content"  # not a call: the rest is content
                self._say(self._after)
                self._after = ""
                return


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    stream_type = Llama3JsonStream
    arguments_key = "parameters"
    template_marker = '"parameters"'  # Llama 3.x templates ask for {"name": ..., "parameters": ...}

    def _calls_grammar(self, call_rule: str, parallel: bool) -> str:
        return f"start: {call_rule}" + (_more_calls('"; "', call_rule) if parallel else "")


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def tool_parser(name: str, make_id: IdMaker = new_call_id) -> ToolParser:
    """The parser `--tool-call-parser NAME` selects; ValueError naming the choices for another name."""
    try:
        return TOOL_PARSERS[name](make_id)
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {sorted(TOOL_PARSERS)}") from None
