"""tool_choice `required` or a named function on a model without a --tool-call-parser, as
vLLM serves it: the answer is held to a JSON schema of the calls (structured outputs), so
any model writes them, and the gateway reads that JSON back as OpenAI tool_calls.

* named: the answer is the function's arguments, one JSON object of its parameters;
* required: a JSON array of {"name": ..., "parameters": {...}} objects, one of the tools
  each, at least one and at most MAX_PARALLEL_CALLS (one when parallel_tool_calls is
  false). The bound is what makes a model that never closes the array end anyway.

The schema ends the answer (the grammar then admits only EOS), so the model stops after
the calls. An answer cut by max_tokens does not parse: it is read as content, the text
as it stands, with finish_reason "length", never as a call with truncated arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway_svc.tool_parsers import MAX_PARALLEL_CALLS, ToolCall, ToolSpec, new_call_id


def required_schema(tools: Sequence[ToolSpec], parallel: bool) -> dict[str, Any]:
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": items, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1}


@dataclass(frozen=True)
class ForcedCalls:
    """How a forced answer reads: `named` is the function a named tool_choice forces; None for
    required (an array of calls)."""

    named: str | None = None

    def calls(self, text: str) -> tuple[ToolCall, ...] | None:
        """The calls of a whole answer; None when it is not (all of) the forced JSON."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.named is not None:
            return (ToolCall(new_call_id(), self.named, _compact(value)),) if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str) and "parameters" in c for c in value):
            return None
        return tuple(ToolCall(new_call_id(), c["name"], _compact(c["parameters"])) for c in value)


def _compact(arguments: Any) -> str:
    """The arguments as OpenAI sends them: JSON text (json.dumps' spacing, as the schema wrote them)."""
    return json.dumps(arguments, ensure_ascii=False)
