"""Between Anthropic's Messages and chat: a request becomes the chat request that runs it;
the chat answer becomes an Anthropic message (text and tool_use blocks, stop_reason, usage).

tool_choice: auto, any (chat's required), tool (a named function), none; tools are
rendered by the chat template as chat's are. serving.v1 ends on EOS and on a stop
sequence alike (finish_reason stop), and names the stop string that ended it: that
reads as stop_reason stop_sequence (with the string), EOS as end_turn.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from gateway_svc.anthropic.types import CountTokensRequest, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock
from gateway_svc.convert import chat_body
from gateway_svc.openai_types import ChatCompletionRequest

STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    system = body.system_text
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": system}] if system else []) + _messages(body)}
    if body.model:  # the base, or a LoRA adapter the request runs through
        chat["model"] = body.model
    if body.tools:
        chat["tools"] = [_function(t) for t in body.tools]
    choice = body.tool_choice
    if choice is not None and body.tools:
        named = {"type": "function", "function": {"name": choice.name}}
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none", "tool": named}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        chat["max_tokens"] = body.max_tokens
        chat["stream"] = body.stream
        sampling = {"stop": body.stop_sequences, "temperature": body.temperature, "top_p": body.top_p,
                    "top_k": body.top_k}  # fmt: skip
        chat |= {k: v for k, v in sampling.items() if v is not None}
    return chat_body(chat)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic turns as chat messages: tool results are chat's tool turns (before the
    user's text that came with them), tool uses the assistant's tool_calls."""
    messages: list[dict[str, Any]] = []
    for message in body.messages:
        text = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
        if message.role == "assistant":
            calls = [_call(b) for b in message.blocks if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text or None} | ({"tool_calls": calls} if calls else {}))
            continue
        results = [b for b in message.blocks if isinstance(b, ToolResultBlock)]
        messages += [{"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text} for r in results]
        if text or not results:
            messages.append({"role": "user", "content": text})
    return messages


def _call(block: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat answer's message as Anthropic content blocks: text, then tool_use."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"],
                       "input": json.loads(function["arguments"])})  # fmt: skip
    return blocks


def stop_reason(reason: str | None, called: bool, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if called and reason == "stop" else STOP_REASONS.get(reason or "stop", "end_turn")


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's: input_tokens are those not read from the cache (the prompt is the sum)."""
    cached = chat_usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": chat_usage["prompt_tokens"] - cached,
        "output_tokens": chat_usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }
