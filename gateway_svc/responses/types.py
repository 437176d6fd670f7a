"""The /v1/responses request body: what we serve, and what we refuse by name.

Input items are messages (roles user, system, developer, assistant; text content), a
model's earlier function_call items and the function_call_output items answering them.
Tools are function tools; the built-in ones (web and file search, computer use, code
interpreter, MCP, image generation, ...) are a 400 naming the tool. So are background
mode, reasoning options, prompt templates, conversations and the rest we cannot honour.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

from gateway_svc.openai_constraints import JsonSchemaFormat
from gateway_svc.openai_fields import INT32_MAX, INT64_MIN, STRICT, UINT64_MAX, Text, _only

FUNCTION_NAME = r"^[a-zA-Z0-9_.-]{1,64}$"


class InputText(BaseModel):
    model_config = STRICT
    # output_text: an assistant message of an earlier response, sent back as input.
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(BaseModel):
    model_config = STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made (an earlier response's output item, sent back as input)."""

    model_config = STRICT
    type: Literal["function_call"]
    call_id: Text
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: Text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = STRICT
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: str | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")]


class FunctionTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """text.format: text, json_object, or json_schema (flat: name, schema, strict at the top)."""

    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("name and schema are given with type json_schema, and only then")
        return self

    def response_format(self) -> dict[str, Any]:
        """As chat's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = JsonSchemaFormat(name=self.name or "", schema=self.schema_, strict=self.strict)
        return {"type": "json_schema", "json_schema": schema.model_dump(by_alias=True, exclude_none=True)}


class TextOptions(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None
    verbosity: Annotated[str | None, _only(lambda v: v is None, "text.verbosity")] = None


def _unserved(what: str) -> Any:
    return _only(lambda v: v in (None, False, [], {}), what)


class ResponsesRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(min_length=1)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # vLLM's sampling extensions, as on chat (openai: extra_body=...).
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    ignore_eos: bool = False
    stop: Text | list[Text] | None = None
    text: TextOptions | None = None
    tools: list[dict[str, Any]] | None = None  # function tools (checked below: the built-in ones are named)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default: the response can be read back and continued
    previous_response_id: str | None = None
    # Fields that cannot change the answer: accepted.
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Annotated[str | None, _only(lambda v: v in (None, "disabled"), "truncation other than disabled")] = None
    # Defined by OpenAI, not served here.
    background: Annotated[bool | None, _unserved("background mode")] = None
    include: Annotated[list[str] | None, _unserved("include")] = None
    reasoning: Annotated[dict[str, Any] | None, _unserved("reasoning options")] = None
    prompt: Annotated[dict[str, Any] | None, _unserved("prompt templates")] = None
    conversation: Annotated[Any, _unserved("conversations (use previous_response_id)")] = None
    max_tool_calls: Annotated[int | None, _unserved("max_tool_calls")] = None
    top_logprobs: Annotated[int | None, _unserved("top_logprobs")] = None
    stream_options: Annotated[dict[str, Any] | None, _unserved("stream_options")] = None

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(f"tools[{i}]: not supported by this server: the built-in tool {kind!r}")
            FunctionTool.model_validate(tool)
        names = [t["name"] for t in value or []]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same function name")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: Any, info: ValidationInfo) -> Any:
        names = {t["name"] for t in info.data.get("tools") or []}
        if value not in (None, "none") and not names:
            raise ValueError("needs tools (none were given)")
        if isinstance(value, NamedFunction) and value.name not in names:
            raise ValueError(f"names function {value.name!r}, which is not among the tools")
        return value

    @property
    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)
