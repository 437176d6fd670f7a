"""Between Responses items and chat: input items (and a stored conversation) become the
chat request that runs them; the chat answer becomes output items and the response object.

A conversation is kept as input items, the output items of each response among them (an
output message or function_call item is also a valid input item), so that
previous_response_id continues it as if the client had sent all of it again.
Instructions are not part of it: each request gives its own, as OpenAI does.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import TypeAdapter

from gateway_svc.convert import chat_body
from gateway_svc.openai_types import ChatCompletionRequest
from gateway_svc.responses.types import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunction,
    ResponsesRequest,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEMS = TypeAdapter(list[InputItem])
LENGTH = "length"


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def chat_request(body: ResponsesRequest, items: list[Item]) -> ChatCompletionRequest:
    """The chat request that answers `body` over the whole conversation `items`."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + chat_messages(items)
    chat: dict[str, Any] = {"messages": messages, "stream": body.stream, "ignore_eos": body.ignore_eos}
    if body.model:  # the base, or a LoRA adapter the request runs through
        chat["model"] = body.model
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction) else choice
        )
    if body.text is not None and body.text.format is not None:
        chat["response_format"] = body.text.format.response_format()
    optional = {
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "stop": body.stop,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    chat |= {k: v for k, v in optional.items() if v is not None}
    return chat_body(chat)


def chat_messages(items: list[Item]) -> list[dict[str, Any]]:
    """Items as chat messages: function calls join the assistant turn they follow."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


# ---- output --------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def output_items(message: dict[str, Any], reason: str | None) -> list[dict[str, Any]]:
    """A chat answer's message as output items: reasoning, text, then the calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "incomplete" if reason == LENGTH else "completed"))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage in the Responses API's names."""
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def response_object(
    response_id: str,
    created: int,
    model: str,
    body: ResponsesRequest,
    output: list[dict[str, Any]],
    reason: str | None,
    used: dict[str, Any] | None,
) -> dict[str, Any]:
    """The response; `reason` None: still running (the stream's first events)."""
    status = "in_progress" if reason is None else "incomplete" if reason == LENGTH else "completed"
    text_format = (
        body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "text": {"format": text_format or {"type": "text"}},
        "tool_choice": body.tool_choice.model_dump()
        if isinstance(body.tool_choice, NamedFunction)
        else (body.tool_choice or ("auto" if body.tools else "none")),
        "tools": body.tools or [],
        "truncation": "disabled",
        "store": body.store,
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": used,
    }
