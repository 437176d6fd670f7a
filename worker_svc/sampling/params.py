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
class LogprobIndices:
    """What the logprob paths index the logits with, on their device: the sampled
    rows that want alternatives, the prompt rows' target ids and the prompt rows
    that want alternatives. The model runner sends them in its step's one upload
    (SamplingParams.index_arrays, then these views of the uploaded buffer), so no
    pageable copy syncs the stream mid-step; a sampler called without them (a
    test, the start-up check) copies them itself (`of`)."""

    top_rows: torch.Tensor  # [R] int64
    prompt_targets: torch.Tensor  # [M] int64
    prompt_top_rows: torch.Tensor  # [P] int64

    @classmethod
    def of(cls, params: SamplingParams, device: torch.device) -> LogprobIndices:
        return cls(*(torch.from_numpy(a).to(device) for a in params.index_arrays()))


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
    indices: LogprobIndices | None = None  # index_arrays() on the device, if the caller uploaded them
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
        return cls(seqs.sampling.take(rows), seqs.context_lens[rows], extras, prompt, input_ids, token_masks=masks)

    @property
    def asks_logprob_indices(self) -> bool:
        """Whether sampling will index with index_arrays(): alternatives or prompt logprobs asked."""
        return self.prompt is not None or any(e.top_logprobs for e in self.extras.values())

    def index_arrays(self) -> list[IntArray]:
        """LogprobIndices' arrays on the host, in its field order."""
        prompt = self.prompt
        targets = prompt.targets if prompt is not None else np.zeros(0, dtype=np.int64)
        prompt_top = np.flatnonzero(prompt.top_n) if prompt is not None else np.zeros(0, dtype=np.int64)
        return [np.flatnonzero(self.top_logprobs), targets.astype(np.int64), prompt_top]

    @property
    def top_logprobs(self) -> IntArray:
        """[N]: alternatives each row asked for (0 for most)."""
        top = np.zeros(len(self), dtype=np.int64)
        for row, e in self.extras.items():
            top[row] = e.top_logprobs
        return top
