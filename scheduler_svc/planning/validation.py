"""The one home of request validation. Every entry point (serving.v1 gRPC,
the planner's admission, and through serving.v1 the HTTP gateway) checks a
request with these functions, so a rule has one answer everywhere. A violation
raises RequestRejected naming the field."""

from __future__ import annotations

import math
from collections.abc import Sequence

from scheduler_svc.request import SamplingOptions

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_SAMPLES = 16
SEED_SPACE = 2**64  # seeds are uint64
MAX_LOGPROBS = 20  # alternatives per position (OpenAI's chat limit; vLLM's default)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency (OpenAI)
MAX_REPETITION_PENALTY = 2.0  # (0, 2] (vLLM)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI
MAX_LOGIT_BIAS = 1024  # entries
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256  # echoed in every message and log line of the request
INT32_MAX = 2**31 - 1  # worker.v1's top_k column
SCHEDULING_POLICIES = ("fcfs", "priority")


class RequestRejected(ValueError):
    """The request can never be served as given."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def default_output_limit(server_default: int, request_default: int | None) -> int:
    """The cap on an unset max_tokens: the scheduler's --default-max-tokens and the
    request's own default_max_tokens (a gateway's), the smaller of those set (0: none)."""
    if request_default is None:
        return server_default
    if request_default < 1:
        raise RequestRejected("default_max_tokens", f"must be >= 1 when set, got {request_default}")
    return min(server_default, request_default) if server_default > 0 else request_default


def output_limit(requested: int | None, prompt_tokens: int, max_model_len: int, default: int = 0) -> int:
    """The context rule (vLLM's, and so the gateway's): prompt + max_tokens must fit
    in max_model_len, or the request is refused naming the maximum context length;
    an unset max_tokens means "up to the context" (within `default`, when > 0: the
    scheduler's --default-max-tokens)."""
    room = max_model_len - prompt_tokens
    if requested is None:
        check_context_room(prompt_tokens, max_model_len)
        return min(default, room) if default > 0 else room
    if requested > room:
        raise RequestRejected(
            "max_tokens",
            f"this model's maximum context length is {max_model_len} tokens, but {prompt_tokens + requested} were "
            f"asked for ({prompt_tokens} in the prompt, max_tokens {requested}): reduce the prompt or max_tokens "
            f"(at most {max(room, 0)} here), or leave max_tokens unset to generate up to the context",
        )
    return requested


def check_sampling(s: SamplingOptions, prefill_only: bool = False) -> None:
    """prefill_only: a pooling request, which generates nothing (max_tokens 0)."""
    if s.max_tokens < 1 and not (s.max_tokens == 0 and (s.prompt_logprobs is not None or prefill_only)):
        raise RequestRejected(
            "max_tokens", f"must be > 0 (or 0 with prompt_logprobs: score the prompt only), got {s.max_tokens}"
        )
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise RequestRejected("temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise RequestRejected("top_p", f"must be in (0, 1], got {s.top_p}")
    if not 0 <= s.top_k <= INT32_MAX:
        raise RequestRejected("top_k", f"must be in [0, {INT32_MAX}] (0 = off), got {s.top_k}")
    if not 0 <= s.min_p <= 1:  # NaN fails too
        raise RequestRejected("min_p", f"must be in [0, 1] (0 = off), got {s.min_p}")
    if s.seed is not None and not 0 <= s.seed < SEED_SPACE:
        raise RequestRejected("seed", f"must be in [0, 2**64), got {s.seed}")
    if len(s.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in s.stop):
        raise RequestRejected("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise RequestRejected(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    _check_penalties(s)
    if not 0 <= s.min_tokens <= s.max_tokens:
        raise RequestRejected("min_tokens", f"must be in [0, max_tokens = {s.max_tokens}], got {s.min_tokens}")


def check_constrained(s: SamplingOptions) -> None:
    """What a structured-output constraint cannot go with: a complete grammar allows
    only EOS, so the output must be free to end there."""
    if s.ignore_eos:
        raise RequestRejected("ignore_eos", "not with a structured output constraint: the output ends with its grammar")
    if s.min_tokens:
        raise RequestRejected(
            "min_tokens", "not with a structured output constraint: the grammar decides where the output may end"
        )


def _check_penalties(s: SamplingOptions) -> None:
    low, high = PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not low <= value <= high:  # NaN fails too
            raise RequestRejected(name, f"must be in [{low:g}, {high:g}], got {value}")
    if not 0 < s.repetition_penalty <= MAX_REPETITION_PENALTY:
        raise RequestRejected(
            "repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {s.repetition_penalty}"
        )
    low, high = LOGIT_BIAS_RANGE
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise RequestRejected("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(s.logit_bias)}")
    bad = next(((t, b) for t, b in s.logit_bias if not low <= b <= high), None)
    if bad is not None:
        raise RequestRejected("logit_bias", f"bias of token {bad[0]} must be in [{low:g}, {high:g}], got {bad[1]}")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestRejected("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(s.stop_token_ids)}")


def check_sampling_token_ids(s: SamplingOptions, vocab_size: int) -> None:
    """Token ids named by the sampling options must be in the vocabulary."""
    for name, ids in (("logit_bias", [t for t, _ in s.logit_bias]), ("stop_token_ids", s.stop_token_ids)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestRejected(name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int | None) -> None:
    """Non-empty, every id in the vocabulary (vocab_size None: the planner, which knows
    no vocabulary, checks only that ids are >= 0)."""
    if not token_ids:
        raise RequestRejected("prompt", "prompt is empty")
    if vocab_size is not None:
        check_in_vocab("prompt_token_ids", token_ids, vocab_size)
    elif min(token_ids) < 0:
        raise RequestRejected("prompt_token_ids", f"token ids must be >= 0, got {min(token_ids)}")


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestRejected("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}")


def check_prompt_chars(num_chars: int, max_chars: int, field: str = "prompt") -> None:
    """A text is refused by its length alone, before it is tokenized: with more than
    `max_chars` characters it cannot fit the context (max_model_len x the longest
    token's characters, or the operator's --max-prompt-chars)."""
    if num_chars > max_chars:
        raise RequestRejected(
            field, f"{num_chars} characters; at most {max_chars} can fit the model's context (--max-prompt-chars)"
        )


def check_priority(priority: int, policy: str) -> None:
    """vLLM's rule: a priority other than 0 needs the priority policy."""
    if priority and policy != "priority":
        raise RequestRejected(
            "priority", f"{priority} needs the scheduler's --scheduling-policy priority (it runs {policy})"
        )


def check_context_room(prompt_tokens: int, max_model_len: int) -> None:
    """A prompt leaves room for at least one generated token within max_model_len."""
    if prompt_tokens >= max_model_len:
        raise RequestRejected(
            "prompt",
            f"this model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{prompt_tokens}: no room is left to generate (at most {max_model_len - 1} prompt tokens)",
        )


def check_prompt_fits(num_tokens: int, max_model_len: int, cache_tokens: int, cache_layout: str) -> None:
    """A prompt leaves room for its first generated token within max_model_len
    (check_context_room) and within the cache_tokens the KV cache can hold for one
    request (cache_layout: how it holds them, for the message)."""
    check_context_room(num_tokens, max_model_len)
    if num_tokens >= cache_tokens:
        raise RequestRejected(
            "prompt",
            f"prompt has {num_tokens} tokens; the KV cache holds {cache_tokens} tokens ({cache_layout}), so at "
            f"most {cache_tokens - 1} prompt tokens fit",
        )


def check_in_vocab(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_num_samples(n: int, num_prompt_tokens: int, sampling: SamplingOptions) -> None:
    if not 1 <= n <= MAX_SAMPLES:
        raise RequestRejected("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    if n > 1 and sampling.prompt_logprobs is not None:
        raise RequestRejected("prompt_logprobs", "not with n > 1 (send one request for the prompt's logprobs)")
    if n > 1 and num_prompt_tokens < 2:
        raise RequestRejected(
            "n", "parallel samples need a prompt of at least 2 tokens (they fork after its second-to-last token)"
        )
