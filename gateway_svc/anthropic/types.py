"""The /v1/messages request body: what we serve, and what we refuse by name.

Content is text, tool_use (an assistant's earlier calls) and tool_result blocks; images,
documents, thinking and server tools (web search, code execution, computer use, ...) are a
400 naming them. `cache_control` marks are accepted: the prefix cache is automatic here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from gateway_svc.openai_fields import INT32_MAX, STRICT, Text, _only

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class TextBlock(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None
    citations: Annotated[list[Any] | None, _only(lambda v: not v, "citations")] = None


class ToolUseBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_use"]
    id: Text
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    model_config = STRICT
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {text}" if self.is_error else text  # the model reads that the tool failed


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(BaseModel):
    model_config = STRICT
    role: Literal["user", "assistant"]
    content: Text | list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _served_blocks(cls, value: Any) -> Any:
        for i, block in enumerate(value if isinstance(value, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in ("text", "tool_use", "tool_result"):
                raise ValueError(f"content[{i}]: not supported by this server: {kind!r} blocks")
        return value

    @property
    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Text | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(BaseModel):
    """What makes the prompt (the body of /v1/messages/count_tokens, and of /v1/messages)."""

    model_config = STRICT

    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None  # custom tools (checked below: server tools are named)
    tool_choice: ToolChoice | None = None
    thinking: Annotated[
        dict[str, Any] | None, _only(lambda v: v is None or v.get("type") == "disabled", "extended thinking")
    ] = None

    @field_validator("tools")
    @classmethod
    def _custom_tools_only(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            if tool.get("type") not in (None, "custom"):
                raise ValueError(f"tools[{i}]: not supported by this server: the server tool {tool.get('type')!r}")
            Tool.model_validate(tool)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = {t["name"] for t in info.data.get("tools") or []}
        if value is not None and value.type in ("any", "tool") and not names:
            raise ValueError("needs tools (none were given)")
        if value is not None and value.type == "tool" and value.name not in names:
            raise ValueError(f"names tool {value.name!r}, which is not among the tools")
        return value

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "".join(b.text for b in self.system) or None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: list[Text] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    # Fields that cannot change the answer: accepted (top-level cache_control: the prefix cache is automatic).
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    cache_control: dict[str, Any] | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    output_config: Annotated[dict[str, Any] | None, _only(lambda v: v is None, "output_config")] = None
    container: Annotated[Any, _only(lambda v: v is None, "containers")] = None
    mcp_servers: Annotated[list[Any] | None, _only(lambda v: not v, "MCP servers")] = None
