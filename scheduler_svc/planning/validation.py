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


class RequestRejected(ValueError):
    """The request can never be served as given."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check_sampling(s: SamplingOptions) -> None:
    if s.max_tokens < 1:
        raise RequestRejected("max_tokens", f"must be > 0, got {s.max_tokens}")
    if not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise RequestRejected("temperature", f"must be a finite number >= 0, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise RequestRejected("top_p", f"must be in (0, 1], got {s.top_p}")
    if s.top_k < 0:
        raise RequestRejected("top_k", f"must be >= 0 (0 = off), got {s.top_k}")
    if s.seed is not None and not 0 <= s.seed < SEED_SPACE:
        raise RequestRejected("seed", f"must be in [0, 2**64), got {s.seed}")
    if len(s.stop) > MAX_STOP_STRINGS or any(len(stop) > MAX_STOP_CHARS for stop in s.stop):
        raise RequestRejected("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")


def check_prompt_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    if not token_ids:
        raise RequestRejected("prompt", "prompt is empty")
    check_in_vocab("prompt_token_ids", token_ids, vocab_size)


def check_in_vocab(field: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRejected(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def check_num_samples(n: int, num_prompt_tokens: int) -> None:
    if not 1 <= n <= MAX_SAMPLES:
        raise RequestRejected("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    if n > 1 and num_prompt_tokens < 2:
        raise RequestRejected(
            "n", "parallel samples need a prompt of at least 2 tokens (they fork after its second-to-last token)"
        )
