"""The step's budget: how many tokens and sequence rows a step may take
(StepBudget, filled while planning), and how large one request's prefill chunk
may be (chunk_limit: fixed, or dynamic with the free share of the KV pool)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from scheduler_svc.request import Request


def chunk_limit(free_fraction: float, *, fixed: int, dynamic: bool, minimum: int, maximum: int, block_size: int) -> int:
    """Largest prefill chunk of one request this step, given the free share of the pool."""
    if not dynamic:
        return fixed
    size = minimum + int((maximum - minimum) * max(0.0, min(1.0, free_fraction)))
    # Whole blocks: a chunk that ends mid-block wastes nothing, but aligned
    # chunks keep every committed chunk fully in the prefix index.
    return max(minimum, size - size % block_size)


class StepBudget:
    """Tokens and sequence slots left in the step being planned, and what got them."""

    def __init__(self, max_tokens: int, max_seqs: int, ahead: bool = False) -> None:
        self.tokens_left = max_tokens
        self.seqs_left = max_seqs
        self.scheduled: dict[str, tuple[Request, int]] = {}  # insertion order = plan order
        self.drafts: dict[str, list[int]] = {}  # request id -> the drafts its decode carries
        self.draft_masks: dict[str, NDArray[np.int32]] = {}  # request id -> its drafting row's position_masks
        self.ahead = ahead  # planned while a step is in flight: no preemption
        self.deferred = False  # ahead, and something did not fit

    def has_room(self) -> bool:
        return self.tokens_left > 0 and self.seqs_left > 0

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = (request, num_tokens)
        self.tokens_left -= num_tokens
        self.seqs_left -= 1
