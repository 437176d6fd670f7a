"""The field types and rules every OpenAI-style request body shares (openai_types.py,
anthropic/, responses/, tokenize, embeddings): serving.v1's limits (int32 counts and
token ids, UTF-8 text), strict JSON types, and the fields known and refused."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
)

INT32_MAX = 2**31 - 1  # what the engine takes for counts and token ids (max_tokens, min_tokens, top_k)
UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20

# Strictly: a request that names an unknown field is refused, not half-served; and a value of
# the wrong JSON type is refused, not coerced ("max_tokens": "8", "stream": "yes", 8.0 for an
# integer), as OpenAI answers. An integer is still a number.
STRICT = ConfigDict(extra="forbid", strict=True)


def _utf8(value: str) -> str:
    """serving.v1 strings are UTF-8: a lone surrogate (JSON "\\ud800") cannot be sent."""
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid UTF-8 text (character {exc.start} is a lone surrogate)") from None
    return value


def _not_bool(value: Any) -> Any:
    """JSON's true and false are not numbers (pydantic would take them as 1 and 0)."""
    if isinstance(value, bool):
        raise ValueError("must be an integer, not true or false")
    return value


Text = Annotated[str, AfterValidator(_utf8)]
Int32 = Annotated[int, BeforeValidator(_not_bool), Field(ge=0, le=INT32_MAX)]
TokenId = Int32  # the scheduler checks them against the vocabulary
Penalty = Annotated[float, Field(ge=-2, le=2)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def _only(ok: Callable[[Any], bool], why: str) -> AfterValidator:
    """A field accepted only at values for which `ok` holds; otherwise a 400 saying `why`."""

    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"not supported by this server: {why}")
        return value

    return AfterValidator(check)


def _is_unset(value: Any) -> bool:
    return value is None


# Fields known and refused (any value but null), and why.
_REFUSED = {
    "guided_decoding_backend": "choosing the grammar backend (this server has one: llguidance)",
    "guided_whitespace_pattern": "a whitespace pattern (JSON is written as json.dumps writes it)",
    "functions": "legacy function calling; use tools",
    "function_call": "legacy function calling; use tools and tool_choice",
    "prediction": "predicted outputs",
    "reasoning_effort": "reasoning_effort",
    "audio": "audio",
    "web_search_options": "web search",
}


def _refuse(value: Any, info: ValidationInfo) -> Any:
    if value is not None:
        raise ValueError(f"not supported by this server: {_REFUSED[info.field_name or '']}")
    return value


Refused = Annotated[Any, AfterValidator(_refuse)]


_TOKEN_ID_KEY = re.compile(r"\s*[0-9]+\s*")  # ASCII digits: str.isdigit() also takes "²", which int() refuses


def _token_id_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
            raise ValueError(f"keys must be token ids in 0..{INT32_MAX}, got {key!r}")
    return value


# OpenAI: token id (a JSON object key, so a string) -> bias in [-100, 100].
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None, AfterValidator(_token_id_keys)]
