"""Structured outputs and tool calling on the way in: the request's constraint
(response_format, structured_outputs or guided_*; or the grammar that forces
tool_choice required / a named function into the --tool-call-parser's format)
as serving.v1's `structured_output` fields, and the refusals of what cannot go
together. The parsers the flags select live here too, checked at start-up
against the model's chat template.

Choices written down (docs/design.md, "Structured outputs and tool calling"):
* vLLM's older guided_json / guided_regex / guided_choice / guided_grammar are
  accepted as vLLM accepts them (the same constraints as structured_outputs);
  guided_decoding_backend and guided_whitespace_pattern are refused.
* tool_choice none: the tools are not rendered into the prompt, the answer is
  plain content. auto: rendered, the answer parsed, nothing enforced.
  required / named: rendered, and the parser's grammar forces the calls, so the
  answer always parses. A response constraint goes only with tool_choice none.
* With --reasoning-parser a chat constraint starts after the reasoning's end
  tag, unless the prompt already closed the reasoning (Qwen3 with thinking off).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway_svc.chat_output import ChatOutput
from gateway_svc.chat_template import ChatTemplate
from gateway_svc.errors import OpenAIError, bad_request
from gateway_svc.forced_tools import ForcedCalls, required_schema
from gateway_svc.openai_constraints import OutputConstraint
from gateway_svc.openai_types import ChatCompletionRequest, SamplingFields
from gateway_svc.reasoning import START_TAG, ReasoningParser, reasoning_parser
from gateway_svc.tool_parsers import ToolParser, ToolSpec, tool_parser
from proto import serving_pb2

TOOL_CHOICE_FIELD = "tool_choice"


@dataclass(frozen=True)
class Parsers:
    """What --tool-call-parser and --reasoning-parser selected (None: off), and whether
    --enable-auto-tool-choice lets the model choose (tool_choice auto)."""

    tool: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    auto: bool = False

    @classmethod
    def load(
        cls, tool_call_parser: str, reasoning: str, model_dir: str, auto: bool = False, template_source: str = ""
    ) -> Parsers:
        """The parsers the flags name; ValueError naming the flag when the model's chat template never
        writes the parser's format (its tools or its reasoning would not be in that format).
        `template_source`: --chat-template's, which replaces the model's."""
        tool = tool_parser(tool_call_parser) if tool_call_parser else None
        thinker = reasoning_parser(reasoning) if reasoning else None
        if auto and tool is None:
            raise ValueError(
                "--enable-auto-tool-choice: needs a --tool-call-parser (to read the calls the model writes)"
            )
        if tool is None and thinker is None:
            return cls()
        template = ChatTemplate.load(model_dir) if model_dir and Path(model_dir).is_dir() else None
        source = template_source or (template.source if template is not None else "")
        if tool is not None and tool.template_marker not in source:
            raise ValueError(
                f"--tool-call-parser {tool.name}: the model's chat template never writes {tool.template_marker!r}: "
                "it does not render tools in that parser's format (pick the parser of this model, or none)"
            )
        if thinker is not None and thinker.end_tag not in source:
            raise ValueError(
                f"--reasoning-parser {thinker.name}: the model's chat template never writes {thinker.end_tag!r}: "
                "this is not a reasoning model of that format"
            )
        return cls(tool, thinker, auto)


def constraint_fields(body: SamplingFields, parsers: Parsers, prompt: str = "") -> tuple[dict[str, Any], str | None]:
    """(serving.v1 GenerateRequest fields, the request field they came from) for the request's
    constraint; ({}, None) without one. `prompt`: a chat request's rendered prompt (reasoning)."""
    constraints = body.output_constraints
    if len(constraints) > 1:
        names = " and ".join(c.field.split(".")[0] for c in constraints)
        raise bad_request(f"only one of {names} may constrain the output", constraints[1].field.split(".")[0])
    constraint = constraints[0] if constraints else None
    if isinstance(body, ChatCompletionRequest) and body.tool_mode != "none":
        constraint = _tool_constraint(body, parsers, constraint)
    if constraint is None:
        return {}, None
    fields = _serving_fields(constraint)
    if isinstance(body, ChatCompletionRequest) and parsers.reasoning is not None:
        if not reasoning_closed(prompt, parsers.reasoning):
            fields["structured_output_after"] = parsers.reasoning.end_tag
    return fields, constraint.field


def chat_reading(body: ChatCompletionRequest, parsers: Parsers) -> ChatOutput:
    """How the answer of a chat request reads: its reasoning, and the calls of its tool_choice."""
    mode = body.tool_mode
    forced = mode in ("required", "named")
    choice = body.tool_choice
    named = choice.function.name if mode == "named" and choice is not None and not isinstance(choice, str) else None
    return ChatOutput(
        parsers.reasoning,
        parsers.tool if mode != "none" else None,
        named=mode == "named",
        forced=ForcedCalls(named) if forced and parsers.tool is None else None,
    )


def _tool_constraint(
    body: ChatCompletionRequest, parsers: Parsers, constraint: OutputConstraint | None
) -> OutputConstraint | None:
    """The constraint of a request offering tools: none for auto, the calls' grammar (the
    parser's format, or JSON without a parser) for required or a named function."""
    mode = body.tool_mode
    if mode == "auto" and not parsers.auto:
        raise bad_request(
            "tool_choice auto (the default with tools) needs the gateway's --enable-auto-tool-choice and "
            "--tool-call-parser (the model's own call format); use tool_choice required, a named function, or none",
            "tool_choice",
        )
    if constraint is not None:
        raise bad_request(
            f"{constraint.field}: not with tools the answer may call (tool_choice {mode}); use tool_choice none",
            constraint.field.split(".")[0],
        )
    if mode == "auto":
        return None
    assert body.tools is not None
    if mode == "named":
        assert not isinstance(body.tool_choice, str) and body.tool_choice is not None
        tools = [t for t in body.tools if t.function.name == body.tool_choice.function.name]
        parallel = False
    else:
        tools, parallel = body.tools, body.parallel_tool_calls is not False
    specs = [ToolSpec(t.function.name, t.function.parameters or ToolSpec(t.function.name).parameters) for t in tools]
    if parsers.tool is None:
        schema = specs[0].parameters if mode == "named" else required_schema(specs, parallel)
        return OutputConstraint("json_schema", schema, TOOL_CHOICE_FIELD, strict=True)
    return OutputConstraint("grammar", parsers.tool.grammar(specs, parallel), TOOL_CHOICE_FIELD)


def _serving_fields(constraint: OutputConstraint) -> dict[str, Any]:
    value = constraint.value
    match constraint.kind:
        case "json_schema":
            fields: dict[str, Any] = {"json_schema": value if isinstance(value, str) else json.dumps(value)}
            if constraint.strict is not None:
                fields["json_schema_strict"] = constraint.strict
            return fields
        case "choice":
            return {"choice": serving_pb2.ChoiceList(choices=value)}
        case kind:
            return {kind: value}


def reasoning_closed(prompt: str, parser: ReasoningParser) -> bool:
    """The prompt itself ends the reasoning (e.g. Qwen3's template with thinking off writes
    `<think>\\n\\n</think>` after the generation prompt): the output is all answer."""
    end = prompt.rfind(parser.end_tag)
    return end >= 0 and end > prompt.rfind(START_TAG) and not prompt[end + len(parser.end_tag) :].strip()


def renamed_error(error: OpenAIError, field: str | None) -> OpenAIError:
    """A scheduler's refusal of the constraint named by the request field it came from."""
    prefix = "structured_output"
    if field is None or error.status != 400 or not error.message.startswith(prefix):
        return error
    rest = error.message.split(":", 1)[1] if ":" in error.message else ""
    return bad_request(f"{field}:{rest}", field.split(".")[0])
