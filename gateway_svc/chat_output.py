"""A chat choice's text as OpenAI's assistant message: the reasoning apart
(`reasoning_content`, --reasoning-parser), the tool calls of an answer to a
request that offered tools (--tool-call-parser), the rest as content; and the
same streamed as chunk deltas, tool calls as OpenAI streams them (a call's id
and name first, then its arguments in pieces). Both ways run the parsers'
incremental machines (reasoning.py, tool_parsers.py), so a stream reassembles
to the non-streamed answer. Order: the model's text -> reasoning -> its
content -> tool calls.

An answer cut by max_tokens inside a call is finish_reason "length" with the
text as it stands as content, never a call with truncated arguments. A forced
answer without a parser (the calls' JSON, forced_tools.py) is held back in a
stream and said whole at its end, so a cut one is never sent; with a parser a
stream says calls piece by piece as they come (a cut one's pieces are then
out, and the stream ends with finish_reason "length")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway_svc.forced_tools import ForcedCalls
from gateway_svc.reasoning import ReasoningDelta, ReasoningParser, ReasoningStream
from gateway_svc.tool_parsers import StreamDelta, ToolCall, ToolCallDelta, ToolParser, ToolStream

LENGTH = "length"


@dataclass(frozen=True)
class ChatOutput:
    """How the choices of one chat response are read."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None  # the request offered tools its answer may call
    named: bool = False  # tool_choice named a function: OpenAI then answers finish_reason "stop"
    # Without a parser: the calls are the JSON a forced tool_choice's schema wrote (forced_tools.py).
    forced: ForcedCalls | None = None

    def message(self, text: str, reason: str | None = None) -> tuple[dict[str, Any], bool]:
        """The non-streamed message of a choice's whole text (which ended for `reason`), and
        whether it called a tool."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            split = self.reasoning.split(text)
            reasoning, content = split.reasoning, split.content
        calls: tuple[ToolCall, ...] = ()
        if self.forced is not None and content is not None and reason != LENGTH:
            found = self.forced.calls(content)
            content, calls = (None, found) if found else (content, ())
        elif self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            if reason != LENGTH or not _cut(parsed.tool_calls):
                content, calls = parsed.content, parsed.tool_calls
        parsing = self.reasoning is not None or self.tools is not None or self.forced is not None
        message: dict[str, Any] = {"role": "assistant", "content": (content or None) if parsing else text}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return message, bool(calls)

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: "tool_calls" when the answer ended on its calls (but a named function's)."""
        return "tool_calls" if called and reason == "stop" and not self.named else reason

    def stream(self) -> ChatStream:
        return ChatStream(self)


def _cut(calls: tuple[ToolCall, ...]) -> bool:
    """The last call's arguments are not whole JSON: the text ended inside it."""
    if not calls:
        return False
    try:
        json.loads(calls[-1].arguments)
    except json.JSONDecodeError:
        return True
    return False


class ChatStream:
    """One streamed choice: text deltas in, OpenAI `delta` objects out."""

    def __init__(self, output: ChatOutput) -> None:
        self._output = output
        self._reasoning: ReasoningStream | None = output.reasoning.stream() if output.reasoning else None
        self._tools: ToolStream | None = output.tools.stream() if output.tools else None
        self._held: list[str] | None = [] if output.forced is not None else None
        self.called = False

    def feed(self, text: str) -> dict[str, Any]:
        if not text:
            return {}
        if self._held is not None:
            self._held.append(text)
            return {}
        split = self._reasoning.feed(text) if self._reasoning is not None else ReasoningDelta(content=text)
        return self._delta(split, self._tools.feed(split.content) if self._tools and split.content else None)

    def finish(self, reason: str | None = None) -> dict[str, Any]:
        """The text has ended (for `reason`): what the parsers held back (a tag that never
        completed), or a held answer whole."""
        if self._held is not None:
            return self._whole("".join(self._held), reason)
        split = self._reasoning.finish() if self._reasoning is not None else ReasoningDelta()
        if self._tools is None:
            return self._delta(split, None)
        held = self._tools.feed(split.content) if split.content else StreamDelta()
        last = self._tools.finish()
        return self._delta(split, StreamDelta(held.content + last.content, held.tool_calls + last.tool_calls))

    def _delta(self, split: ReasoningDelta, parsed: StreamDelta | None) -> dict[str, Any]:
        content = split.content if parsed is None and self._tools is None else (parsed.content if parsed else "")
        delta: dict[str, Any] = {}
        if split.reasoning:
            delta["reasoning_content"] = split.reasoning
        if content:
            delta["content"] = content
        if parsed is not None and parsed.tool_calls:
            self.called = True
            delta["tool_calls"] = [_call_delta(call) for call in parsed.tool_calls]
        return delta

    def _whole(self, text: str, reason: str | None) -> dict[str, Any]:
        message, self.called = self._output.message(text, reason)
        delta = {k: v for k, v in message.items() if k in ("reasoning_content", "content") and v}
        calls = message.get("tool_calls", [])
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta


def _call_delta(call: ToolCallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    function = {"name": call.name, "arguments": call.arguments}
    return {"index": call.index, "id": call.id, "type": "function", "function": function}
