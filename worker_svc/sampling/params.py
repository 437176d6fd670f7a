"""What the sampler is asked: the sampled rows' parameters as columns, and the
rows to score for prompt logprobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from worker_svc.step.input import IntArray, RowExtras, SamplingColumns, SeqColumns, TokenMasks, ranges


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
        drafts = seqs.drafts
        extras = {
            int(where[row]): after_drafts(e, chunk_drafts(seqs, row)) if drafts[row] else e
            for row, e in seqs.extras.items()
            if where[row] >= 0
        }
        masks = None if token_masks is None else (lambda: token_masks().take(where))
        return cls(seqs.sampling.take(rows), seqs.context_lens[rows], extras, prompt, input_ids, token_masks=masks)

    @classmethod
    def of_drafted_positions(cls, seqs: SeqColumns, rows: IntArray) -> SamplingParams:
        """The parameters of every position before the last of the drafting rows `rows`
        (step rows), row after row, each sampled as one-token decoding would have
        sampled it (sampling/verify.py): the row's options, the position of the token
        it samples (a seeded row's noise key), its penalties counting the drafts
        before it, and its mask for that position (seqs.draft_masks). A row's blocked
        ids and logit bias hold at every position."""
        counts = seqs.drafts[rows]
        # Chunk position i of a row's last K + 1 samples the token at start_pos + n - K + i.
        firsts = seqs.context_lens[rows] - counts
        positions = ranges(firsts, counts)
        starts = np.cumsum(counts) - counts
        extras: dict[int, RowExtras] = {}
        for start, row in zip(starts.tolist(), rows.tolist()):
            if (e := seqs.extras.get(row)) is not None:
                drafts = chunk_drafts(seqs, row)
                extras.update({start + i: after_drafts(e, drafts[:i]) for i in range(len(drafts))})
        masks = _inner_masks(seqs.draft_masks, rows, starts, len(seqs))
        token_masks = None if masks is None else (lambda: masks)
        return cls(seqs.sampling.take(np.repeat(rows, counts)), positions, extras, token_masks=token_masks)

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


def _inner_masks(draft_masks: TokenMasks | None, rows: IntArray, starts: IntArray, num_rows: int) -> TokenMasks | None:
    """The drafting rows' inner-position masks renamed to the positions of
    of_drafted_positions: the j-th entry of a step row is its position starts[k] + j,
    where rows[k] is that step row."""
    if draft_masks is None or not len(draft_masks):
        return None
    first_of = np.full(num_rows, -1, dtype=np.int64)
    first_of[rows] = starts
    listed = draft_masks.rows
    nth = np.arange(len(listed)) - np.searchsorted(listed, listed)  # entries are grouped by row, ascending
    return TokenMasks(first_of[listed] + nth, draft_masks.words)


def chunk_drafts(seqs: SeqColumns, row: int) -> list[int]:
    """The drafts a row carries: the last num_drafts tokens of its chunk."""
    end = int(seqs.token_starts[row] + seqs.num_tokens[row])
    return [int(t) for t in seqs.token_ids[end - int(seqs.drafts[row]) : end]]


def after_drafts(extras: RowExtras, drafts: Sequence[int]) -> RowExtras:
    """A row's options at the position after `drafts`: its penalties count them as
    generated, as one-token decoding would have by then (the wire's output ids are
    those generated before the chunk)."""
    p = extras.penalties
    if p is None or not len(drafts):
        return extras
    counted = dataclasses.replace(p, output_token_ids=(*p.output_token_ids, *drafts))
    return dataclasses.replace(extras, penalties=counted)
