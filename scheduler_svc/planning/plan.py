"""The typed objects a step crosses boundaries as: the plan the planner makes
(StepPlan of ScheduledSeq rows), what the worker sampled (StepSamples) and what
the step did for each request (RequestUpdate). Every room that talks about a
step (the engine, the worker client, the metrics) imports them from here, below
the planner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from scheduler_svc.kv.offload import NO_TRANSFERS, TierTransfers
from scheduler_svc.request import FinishReason, Request, SamplingOptions, TokenLogprob

if TYPE_CHECKING:
    from scheduler_svc.structured.matcher import GrammarMatcher


class RowPooling(enum.IntEnum):
    """What a row of a pooling request asks the worker for (worker.v1 Pooling)."""

    NONE = 0
    LAST = 1  # the chunk's last position's hidden state
    SUM = 2  # the sum of the chunk's hidden states


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: one row of worker.v1.SeqColumns."""

    request_id: str
    seq_id: int
    token_ids: list[int]  # a prefill chunk, or one decode token
    start_pos: int  # tokens of this sequence already in cache
    block_table: list[int]  # physical blocks for [0, start_pos + len(token_ids))
    slot_mapping: list[int]  # block * block_size + offset, one per token
    sample: bool  # the chunk reaches the last known token: sample the next one
    sampling: SamplingOptions
    # The one input token is the one this sequence samples in the step in
    # flight before this one (token_ids then holds a placeholder).
    token_from_previous_step: bool = False
    # Prompt logprobs: the prompt token after each of the chunk's first len(...) positions.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # Tokens the sample may not pick (min_tokens not reached: EOS and stop ids).
    blocked_token_ids: tuple[int, ...] = ()
    # Penalties: the tokens generated before this sample (a token_from_previous_step
    # input is counted by the worker) and the prompt's distinct ids (repetition only).
    penalty_output_ids: tuple[int, ...] = ()
    penalty_prompt_ids: tuple[int, ...] = ()
    num_drafts: int = 0  # the last num_drafts of token_ids are drafts for the worker to verify
    # Structured outputs (sampling rows of a request with a grammar): the matcher the
    # row's mask comes from, and whether that mask follows the step (the input is
    # token_from_previous_step, so the matcher is one token behind until it is applied).
    grammar: GrammarMatcher | None = None
    mask_follows: bool = False
    # A constrained row with drafts: the mask of each verified position, [num_drafts + 1, W]
    # (row i: after the input and i drafts; the last is the sampled position's), computed
    # when planned (speculation.constrained_drafts); None: unconstrained or no drafts.
    position_masks: NDArray[np.int32] | None = None
    pooling: RowPooling = RowPooling.NONE  # a pooling request's chunk (planning/pooling.py)
    lora_slot: int = 0  # the worker's adapter slot its tokens run through (0: the base model)
    return_logits: bool = False  # the sampled position's logits row comes back (a classifier's last chunk)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True, frozen=True)
class PrefillProgress:
    request_id: str
    processed: int  # prompt tokens computed once this step is done (cache hits included)
    total: int  # prompt tokens


@dataclass(slots=True)
class PlanMasks:
    """Allowed-token masks of some sampling rows of a plan (worker.v1 TokenMasks)."""

    rows: list[int]  # indexes into StepPlan.seqs, ascending
    words: NDArray[np.int32]  # [len(rows), W]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies, done first
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    prefill_progress: list[PrefillProgress] = field(default_factory=list)  # first prefill only
    preempted: list[str] = field(default_factory=list)  # request ids preempted while planning
    previous_step_id: int | None = None  # planned ahead of this step's result (overlapped scheduling)
    deferred: bool = False  # planned ahead, something did not fit: drain the pipeline before the next plan
    masks: PlanMasks | None = None  # set by the engine before sending: the masks of rows whose input is known
    # Set by the engine: the late masks of step previous_step_id (its mask_follows rows), taken along.
    previous_masks: PlanMasks | None = None
    transfers: TierTransfers = NO_TRANSFERS  # copies between the KV tiers (kv/tiers.py), done first

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.seqs)

    @property
    def late_mask_rows(self) -> list[int]:
        """The rows whose masks follow the step."""
        return [row for row, seq in enumerate(self.seqs) if seq.mask_follows]

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.copies and not self.transfers


Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(slots=True)
class StepSamples:
    """What a step sampled, as the worker answered it: one row per sampling sequence,
    as columns in the worker's row order (a sequence finds its row by seq_id), and
    the rarely asked extras only for the rows that asked."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top: dict[int, Alternatives] = field(default_factory=dict)  # seq_id -> the sampled token's alternatives
    # seq_id -> one (logprob, alternatives) per ScheduledSeq.prompt_logprob_targets entry
    prompt: dict[int, list[tuple[float, Alternatives]]] = field(default_factory=dict)
    # Per row: drafts accepted, token_ids[row] following them (empty: the step carried none),
    # and the accepted drafts' logprobs, row after row.
    num_accepted: list[int] = field(default_factory=list)
    draft_logprobs: list[float] = field(default_factory=list)
    pooled: dict[int, NDArray[np.float32]] = field(default_factory=dict)  # seq_id -> a pooling row's vector
    logits: dict[int, NDArray[np.float32]] = field(default_factory=dict)  # seq_id -> a return_logits row's
    rows: dict[int, int] = field(init=False, repr=False)  # seq_id -> row

    def __post_init__(self) -> None:
        self.rows = dict(zip(self.seq_ids, range(len(self.seq_ids))))

    def accepted(self, row: int) -> tuple[int, list[float]]:
        """(drafts accepted, their logprobs) of a row."""
        if not self.num_accepted:
            return 0, []
        start = sum(self.num_accepted[:row])  # only drafting rows ask: a few per step
        count = self.num_accepted[row]
        return count, self.draft_logprobs[start : start + count]


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: the planner's answer to the engine, which
    streams it to the request's client. A step samples at most one token per request."""

    request_id: str
    token_id: int | None = None  # sampled this step
    logprob: float = 0.0  # the token's
    top_logprobs: Alternatives | None = None  # the token's alternatives, with sampling.logprobs
    # With sampling.prompt_logprobs: prompt tokens 1.. (the first has none), once, with the
    # first token (or the end of a request that scores the prompt only).
    prompt_logprobs: list[TokenLogprob] | None = None
    prefill_progress: tuple[int, int] | None = None  # (processed, total) for a chunk that sampled nothing
    finished: bool = False
    finish_reason: FinishReason | None = None
    forked: bool = False  # a prefill-only parent finished: its children now run
    # Set on the tokens of an accepted run of drafts: the request's outputs once this
    # token is in (a stop string found here drops the run's later tokens).
    num_output_tokens: int = 0
    # The request ended with this error instead (its grammar refused the token: TokenRejected,
    # or hit a limit: GrammarFailed); the token is not in its outputs.
    error: Exception | None = None
    embedding: list[float] | None = None  # a pooling request's output when it finishes (a classifier's: [score])


def prompt_total(request: Request) -> int:
    """Prompt tokens as the client sees them: a fork parent holds all but the last."""
    return request.num_prompt_tokens + (1 if request.prefill_only else 0)
