"""The Responses API's typed event stream, from a chat answer's stream deltas.

Each output item opens (response.output_item.added), grows (text, reasoning or
arguments deltas) and closes (the matching .done events, then
response.output_item.done); the stream starts with response.created and
response.in_progress and ends with response.completed (or response.incomplete
at max_output_tokens), whose response is the non-streamed one. Every event is
`event: TYPE` + `data: {..., "type": TYPE, "sequence_number": N}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gateway_svc.responses.items import call_item, message_item, new_id, reasoning_item


class ResponseEvents:
    """The events of one streamed response, item by item."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._text: list[str] = []  # its text or arguments so far

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def delta(self, delta: dict[str, Any]) -> Iterator[str]:
        """The events of one chat delta (reasoning_content, content, tool_calls pieces)."""
        if delta.get("reasoning_content"):
            yield from self._grow("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            yield from self._grow("message", delta["content"])
        for piece in delta.get("tool_calls") or []:
            function = piece.get("function", {})
            if piece.get("id") is not None:
                yield from self.close()
                yield from self._start(call_item(new_id("fc"), piece["id"], function["name"], "", "in_progress"))
            if function.get("arguments"):
                yield from self._grow("function_call", function["arguments"])

    def close(self, status: str = "completed") -> Iterator[str]:
        item = self._open
        if item is None:
            return
        text, at, item_id = "".join(self._text), len(self.output), item["id"]
        where = {"item_id": item_id, "output_index": at}
        if item["type"] == "message":
            item = message_item(item_id, text, status)
            part = item["content"][0]
            yield self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            item = reasoning_item(item_id, text)
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            item = {**item, "arguments": text, "status": "completed"}
            yield self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)
        yield self.event("response.output_item.done", output_index=at, item=item)
        self.output.append(item)
        self._open, self._text = None, []

    def _grow(self, kind: str, text: str) -> Iterator[str]:
        if self._open is None or self._open["type"] != kind:
            yield from self.close()
            if kind == "message":
                yield from self._start(message_item(new_id("msg"), "", "in_progress") | {"content": []})
            else:
                yield from self._start(reasoning_item(new_id("rs"), "") | {"content": []})
        assert self._open is not None
        self._text.append(text)
        where = {"item_id": self._open["id"], "output_index": len(self.output)}
        names = {"message": "output_text", "reasoning": "reasoning_text", "function_call": "function_call_arguments"}
        content = {} if kind == "function_call" else {"content_index": 0}
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        yield self.event(f"response.{names[kind]}.delta", **where, **content, delta=text, **extra)

    def _start(self, item: dict[str, Any]) -> Iterator[str]:
        self._open, self._text = item, []
        yield self.event("response.output_item.added", output_index=len(self.output), item=item)
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
            yield self.event("response.content_part.added", **where, part=part)
