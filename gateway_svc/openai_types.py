"""OpenAI request bodies as pydantic models: what we accept, and what we reject.

Unknown fields are ignored (clients send `user`, `metadata`, ...), but fields
that would change the answer and that we cannot honour (suffix, tools) are
rejected with a 400 naming the field, instead of silently returning something
the caller did not ask for. Ranges are OpenAI's (logprobs up to 20 as vLLM
allows); the scheduler checks them again (scheduler_svc/planning/validation.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

UINT64_MAX = 2**64 - 1
INT64_MIN = -(2**63)
# serving.v1 token ids are int32; the scheduler checks them against the vocabulary.
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def _only(ok: Callable[[Any], bool], allowed: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not ok(value):
            raise ValueError(f"not supported by this server (only {allowed})")
        return value

    return AfterValidator(check)


MAX_LOGPROBS = 20
Penalty = Annotated[float, Field(ge=-2, le=2)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def _token_id_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not key.strip().isdigit():
            raise ValueError(f"keys must be token ids, got {key!r}")
    return value


# OpenAI: token id (a JSON object key, so a string) -> bias in [-100, 100].
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]] | None, AfterValidator(_token_id_keys)]
# Accepted only at their no-op value.
NoTools = Annotated[list[Any] | None, _only(lambda v: not v, "no tools")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    # One model per gateway: `model` is not checked; responses name the served model.
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    # top_k and ignore_eos are vLLM-style extensions (openai: extra_body=...).
    top_k: int | None = Field(default=None, ge=0)
    ignore_eos: bool = False
    # OpenAI seeds are signed 64-bit; serving.v1 takes uint64 (we wrap negatives).
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias = None
    # vLLM-style extensions (openai: extra_body=...).
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[TokenId] | None = None

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    # A string, a batch of strings, token ids, or a batch of token-id lists.
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # 0 only with echo: the prompt scored, nothing generated.
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: Logprobs | None = None
    suffix: Annotated[str | None, _only(lambda v: not v, "null")] = None
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

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
            texts.append(part["text"])
        return "".join(texts)

    def for_template(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Newer OpenAI name for max_tokens; it wins when both are given.
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: NoTools = None
    response_format: Annotated[
        dict[str, Any] | None, _only(lambda v: v is None or v.get("type") == "text", "{'type': 'text'}")
    ] = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
