"""A serving.v1 message's prompt (text or token ids) as token ids, validated."""

from __future__ import annotations

from proto import serving_pb2
from scheduler_svc.engine.engine import Engine
from scheduler_svc.planning.validation import RequestRejected, check_prompt_chars, check_prompt_ids


async def prompt_from_proto(
    msg: serving_pb2.GenerateRequest | serving_pb2.PinPrefixRequest | serving_pb2.EmbedRequest,
    engine: Engine,
    max_chars: int,
) -> list[int]:
    """Token ids of a message with `prompt` / `prompt_token_ids` (exactly one). A text
    longer than `max_chars` is refused unread; a long one is tokenized off the event loop."""
    has_text, has_ids = bool(msg.prompt), bool(msg.prompt_token_ids)
    if has_text == has_ids:
        raise RequestRejected("prompt", "give exactly one of prompt (non-empty text) and prompt_token_ids")
    if has_ids:
        prompt_ids = list(msg.prompt_token_ids)
        check_prompt_ids(prompt_ids, engine.tokenizer.vocab_size)
        return prompt_ids
    check_prompt_chars(len(msg.prompt), max_chars)
    prompt_ids = await engine.tokenizer.encode_async(msg.prompt)
    if not prompt_ids:
        raise RequestRejected("prompt", "the prompt encodes to no tokens")
    return prompt_ids
