"""What the sampler is asked: the sampled rows' parameters as columns, and the
rows to score for prompt logprobs."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.step.input import IntArray, RowExtras, SamplingColumns, SeqColumns, TokenMasks


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Logit rows after the samples' whose logprob of a given token is wanted (prompt logprobs)."""

    targets: IntArray  # [M] token id after each row's position
    top_n: IntArray  # [M] alternatives wanted per row


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """One entry per row to sample, in the order of the logits' rows; then what
    else the sampler is asked for those logits."""

    columns: SamplingColumns
    positions: IntArray  # the position of the token each row samples: a seeded row's noise key
    extras: Mapping[int, RowExtras] = field(default_factory=dict)  # row -> its rare options
    prompt: PromptScoring | None = None  # the logit rows after the sampled ones: score these
    # The token input at each sampled position, on the device: asked for only when a
    # penalty counts it (a decode whose input is the previous step's sample).
    input_ids: Callable[[], torch.Tensor] | None = None
    # Structured outputs: the allowed-token masks of some rows (rows of these params), asked for
    # at sampling: a step planned ahead gets them only then (runner/late_masks.py).
    token_masks: Callable[[], TokenMasks] | None = None

    def __len__(self) -> int:
        return len(self.positions)

    @classmethod
    def of_rows(
        cls,
        seqs: SeqColumns,
        rows: IntArray,
        prompt: PromptScoring | None = None,
        input_ids: Callable[[], torch.Tensor] | None = None,
        token_masks: Callable[[], TokenMasks] | None = None,
    ) -> SamplingParams:
        """The parameters of the step's rows `rows`, in that order; extras are
        looked at only for the rows that have them. `token_masks`: the step's masks
        (step rows), asked for when the sampler needs them."""
        where = np.full(len(seqs), -1, dtype=np.int64)
        where[rows] = np.arange(len(rows))
        extras = {int(where[row]): e for row, e in seqs.extras.items() if where[row] >= 0}
        masks = None if token_masks is None else (lambda: token_masks().take(where))
        return cls(seqs.sampling.take(rows), seqs.context_lens[rows], extras, prompt, input_ids, masks)

    @property
    def top_logprobs(self) -> IntArray:
        """[N]: alternatives each row asked for (0 for most)."""
        top = np.zeros(len(self), dtype=np.int64)
        for row, e in self.extras.items():
            top[row] = e.top_logprobs
        return top
