"""OpenAI request bodies as pydantic models: what we accept, and what we refuse.

The one place request fields are checked (FastAPI runs these models before a
route sees the body), with the limits serving.v1 can carry (int32 counts and
token ids, UTF-8 text), so nothing that passes here fails in the proto
conversion. Every field is honoured or refused with a 400 naming it:

* unknown fields are refused (`extra="forbid"`), as OpenAI answers
  "Unrecognized request argument supplied"; fields that cannot change the
  answer (`user`, `metadata`, `service_tier`, ...) are accepted and named here;
* known fields we cannot honour yet (legacy functions, ...) are
  declared with a refusal saying why, so the 400 is specific.

Structured outputs come from one of OpenAI's `response_format`, vLLM's
`structured_outputs` or vLLM's older `guided_*` fields (accepted as vLLM
accepts them), never two (`OutputConstraint`); tools (`Tool`, `ToolChoice`)
are chat's. gateway_svc/structured.py turns them into serving.v1's fields.

Ranges are OpenAI's (logprobs up to 20 as vLLM allows); the scheduler checks
them again (scheduler_svc/planning/validation.py) for its gRPC clients.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gateway_svc.openai_constraints import (
    GUIDED,
    Choices,
    JsonSchema,
    OutputConstraint,
    ResponseFormat,
    StructuredOutputs,
)
from gateway_svc.openai_fields import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    STRICT,
    UINT64_MAX,
    Int32,
    LogitBias,
    Logprobs,
    Penalty,
    Refused,
    Text,
    TokenId,
    _is_unset,
    _only,
    _utf8,
)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (guidellm sends it).
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT

    # The served model's id (--model-name), or absent; another id is a 404 (app.py).
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    # Newer OpenAI name for max_tokens (vLLM takes it on completions too); it wins when both are given.
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # top_k, min_p, ignore_eos, ... are vLLM's extensions (openai: extra_body=...). top_k -1 = off, as in vLLM.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    ignore_eos: bool = False
    # OpenAI seeds are signed 64-bit; serving.v1 takes uint64 (we wrap negatives).
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    stop: Text | list[Text] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias = None
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: Int32 = 0
    stop_token_ids: list[TokenId] | None = None
    # Requests share prefix-cache blocks only with requests of the same salt (vLLM's field).
    cache_salt: Text | None = None
    # vLLM's: with the scheduler's --scheduling-policy priority lower values go first (else only 0).
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    # pagedserve's (vLLM has no per-request switch): serving.v1's no_speculation, as an extra body field.
    no_speculation: bool = Field(
        default=False,
        description="pagedserve extension: true = this request decodes one token a step, without the scheduler's "
        "speculative drafts (--speculative-method); the tokens are the same either way",
    )
    # Fields that cannot change the answer: accepted.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: Annotated[bool | None, _only(lambda v: not v, "store: true (nothing is stored)")] = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older
    # guided_* fields (at most one of them: gateway_svc/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: Text | None = None
    guided_choice: Choices | None = None
    guided_grammar: Text | None = None
    guided_decoding_backend: Refused = None
    guided_whitespace_pattern: Refused = None

    @property
    def output_constraints(self) -> list[OutputConstraint]:
        """What the output must match, from every field that says (more than one is a 400)."""
        found = [self.response_format.constraint() if self.response_format else None]
        found.append(self.structured_outputs.constraint() if self.structured_outputs else None)
        for name, kind in GUIDED.items():
            if (value := getattr(self, name)) is not None:
                found.append(OutputConstraint(kind, value, name))  # type: ignore[arg-type]
        return [c for c in found if c is not None]

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def top_k_or_none(self) -> int | None:
        """serving.v1's top_k: -1 (off in vLLM) is unset, the scheduler's 0 = off; capped to int32
        (no vocabulary is larger)."""
        return None if self.top_k is None or self.top_k < 0 else min(self.top_k, INT32_MAX)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's rule: continuous_usage_stats counts only with include_usage."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingFields):
    # The published schema says what the route checks across fields: max_tokens 0 only with echo.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"properties": {"max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}}},
                {"required": ["echo"], "properties": {"echo": {"const": True}}},
            ]
        },
    )

    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt scored, nothing generated. Unset: OpenAI's 16 (convert.py).
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: Logprobs | None = None
    suffix: Annotated[str | None, _only(lambda v: not v, "suffix (insertion)")] = None
    best_of: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _non_empty_batch(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("must not be an empty list")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each a text or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ToolCallFunction(BaseModel):
    model_config = STRICT
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = STRICT
    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict[str, Any]:
        """Chat templates read `function.arguments` as an object (HF's convention, as vLLM passes it)."""
        try:
            arguments = json.loads(self.function.arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"function.arguments of tool call {self.id!r} is not JSON: {exc}") from None
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # the arguments are always held to the schema when a call is forced


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """As HF chat templates read `tools` (the OpenAI JSON, unset fields left out)."""
        return self.model_dump(exclude_none=True, by_alias=True)


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    # The published schema says what _tool_turns checks: a tool message names the call it answers.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string", "minLength": 1}}},
        },
    )

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[dict[str, Any]] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: which call it answers
    # What the openai client sends back when a previous answer is put in the history.
    refusal: Annotated[str | None, _only(_is_unset, "refusal")] = None
    annotations: Annotated[list[Any] | None, _only(lambda v: not v, "annotations")] = None
    audio: Refused = None
    function_call: Refused = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, value: Any) -> str:
        """Flatten content parts to one string: the template and the model take text only."""
        if value is None or isinstance(value, str):
            return value or ""
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            texts.append(_utf8(part["text"]))
        return "".join(texts)

    @model_validator(mode="after")
    def _tool_turns(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatRendering(BaseModel):
    """How the chat template renders the messages (vLLM's fields; /tokenize takes them too)."""

    model_config = STRICT

    add_generation_prompt: bool = True
    # The last (assistant) message is left open for the model to go on with.
    continue_final_message: bool = False
    # More variables for the template (e.g. enable_thinking); they cannot replace the ones above.
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_names(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(
            (value or {}).keys() & {"messages", "add_generation_prompt", "continue_final_message", "tools"}
        )
        if reserved:
            raise ValueError(f"must not set {', '.join(reserved)} (use the request's own fields)")
        return value


class ChatCompletionRequest(ChatRendering, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[Tool] | None = None
    # Unset: auto with tools, none without (OpenAI's default).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # tool_choice required: more than one call (default true)
    functions: Refused = None
    function_call: Refused = None
    echo: Annotated[bool, _only(lambda v: not v, "echo on chat completions")] = False
    modalities: Annotated[list[str] | None, _only(lambda v: v in (None, ["text"]), "modalities other than text")] = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    audio: Refused = None
    web_search_options: Refused = None

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.function.name for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same function name")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        if value not in (None, "none") and not tools:
            raise ValueError("needs tools (none were given)")
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names function {value.function.name!r}, which is not among the tools")
        return value

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the answer may use the tools: none (no tools, or tool_choice none), auto, required, named."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"
