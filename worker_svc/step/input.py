"""What a Step asks for, as columns: one numpy array per column, as worker.v1
carries them (server.py converts; nothing else reads the proto). Row i of every
per-row column is the i-th scheduled sequence; the flat columns hold every row's
values end to end, in row order. A step stays in this form through validation,
batch building and sampling: no Python object per row, except `RowExtras` for
the few rows that use a rare option.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

IntArray = npt.NDArray[np.int64]
UIntArray = npt.NDArray[np.uint64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float32]
Int32Array = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class Penalties:
    """OpenAI presence/frequency and HF repetition penalties over a sequence's tokens."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0  # 1 = off
    output_token_ids: Sequence[int] = ()  # generated so far, as the step was planned
    prompt_token_ids: Sequence[int] = ()  # the prompt's distinct ids (repetition only)
    # The input token is the previous step's sample (token_from_previous_step), which the
    # scheduler had not seen: it counts as generated too.
    count_input_token: bool = False


@dataclass(frozen=True, slots=True)
class RowExtras:
    """A row's rarely used options (worker.v1 SeqExtras): only the rows that use one have these."""

    top_logprobs: int = 0  # alternatives returned with the sampled token
    # Logit processing (in this order): -inf, + bias, penalties.
    blocked_token_ids: Sequence[int] = ()
    logit_bias_token_ids: Sequence[int] = ()
    logit_bias_values: Sequence[float] = ()
    penalties: Penalties | None = None
    # Prompt logprobs: the token after each of the first len(...) positions of the row's chunk.
    prompt_logprob_targets: Sequence[int] = ()
    prompt_top_logprobs: int = 0

    @property
    def processes_logits(self) -> bool:
        return bool(len(self.blocked_token_ids) or len(self.logit_bias_token_ids) or self.penalties)


@dataclass(frozen=True, slots=True)
class SamplingColumns:
    """The sampling parameters, one entry per row (read on sampling rows only)."""

    temperature: FloatArray  # 0 = greedy
    top_p: FloatArray  # 0 or 1 = off
    top_k: IntArray  # 0 = off
    seeds: UIntArray  # read where `seeded`
    seeded: BoolArray
    min_p: FloatArray  # 0 = off: keep tokens at least min_p times as likely as the top one

    def take(self, rows: IntArray) -> SamplingColumns:
        return SamplingColumns(
            self.temperature[rows],
            self.top_p[rows],
            self.top_k[rows],
            self.seeds[rows],
            self.seeded[rows],
            self.min_p[rows],
        )


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """Allowed-token bitmasks of some rows (structured outputs), a sparse column:
    row rows[i] may sample token t iff bit t % 32 of words[i, t // 32] is set."""

    rows: IntArray  # [M] the rows they belong to (step rows on the wire, sampled rows in SamplingParams)
    words: Int32Array  # [M, W] little-endian int32 words, W = ceil(vocab / 32)

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, where: IntArray) -> TokenMasks:
        """The same masks with each row renamed to where[row]."""
        return TokenMasks(where[self.rows], self.words)

    @staticmethod
    def join(parts: Sequence[TokenMasks]) -> TokenMasks:
        return TokenMasks(np.concatenate([p.rows for p in parts]), np.concatenate([p.words for p in parts]))


def _no_rows() -> IntArray:
    return np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class SeqColumns:
    """A step's sequences (all integer columns int64 but seq_ids)."""

    seq_ids: UIntArray  # [S] the scheduler's ids, unique in a step
    start_pos: IntArray  # [S] tokens already in the cache
    num_tokens: IntArray  # [S] the row's share of token_ids and slot_mapping
    table_lens: IntArray  # [S] the row's share of block_tables
    sample: BoolArray  # [S] sample a token after the row's last position
    from_previous: BoolArray  # [S] the input is the token this row sampled in the previous step
    return_logits: BoolArray  # [S] return the fp32 logits row of the sampled position
    sampling: SamplingColumns  # [S]
    token_ids: IntArray  # [T] each row's chunk, or its decode token (a placeholder with from_previous)
    slot_mapping: IntArray  # [T] where each token's K/V go; < 0: not written
    block_tables: IntArray  # [B] each row's whole table
    extras: Mapping[int, RowExtras] = field(default_factory=dict)  # row -> its rare options
    # Speculative decoding: [S] the row's last num_drafts tokens are drafts to verify
    # (sampling/verify.py); empty: no row carries any.
    num_drafts: IntArray = field(default_factory=_no_rows)
    # Structured outputs: the masks sent with the step, and the rows whose masks follow
    # in a StepMasks call (SEQ_FLAG_MASK_FOLLOWS).
    masks: TokenMasks | None = None
    late_mask_rows: IntArray = field(default_factory=_no_rows)
    # The inner positions' masks of the drafting rows in `masks` (their last position's):
    # each such row num_drafts times, ascending, in position order (worker.v1 draft_masks).
    draft_masks: TokenMasks | None = None
    # Pooling: [S] a POOLING_* value per row (0: none); empty: no row pools.
    pooling: IntArray = field(default_factory=_no_rows)
    # LoRA: [S] the adapter slot of each row (0: the base model); empty: every row's is 0.
    lora_slots: IntArray = field(default_factory=_no_rows)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def drafts(self) -> IntArray:
        """[S] drafts per row, 0 on every row when the step carries none."""
        return self.num_drafts if len(self.num_drafts) else np.zeros(len(self.seq_ids), dtype=np.int64)

    @property
    def adapter_slots(self) -> IntArray:
        """[S] each row's adapter slot, 0 on every row when the step names none."""
        return self.lora_slots if len(self.lora_slots) else np.zeros(len(self.seq_ids), dtype=np.int64)

    @property
    def pooled_rows(self) -> IntArray:
        """The rows that return pooled hidden states, in step order."""
        return np.flatnonzero(self.pooling) if len(self.pooling) else _no_rows()

    @property
    def context_lens(self) -> IntArray:
        return self.start_pos + self.num_tokens

    @property
    def token_starts(self) -> IntArray:
        """[S]: where each row's tokens start in token_ids and slot_mapping."""
        return np.cumsum(self.num_tokens) - self.num_tokens

    @property
    def table_starts(self) -> IntArray:
        """[S]: where each row's table starts in block_tables."""
        return np.cumsum(self.table_lens) - self.table_lens

    @property
    def positions(self) -> IntArray:
        """[T]: each token's position in its sequence."""
        return ranges(self.start_pos, self.num_tokens)

    @classmethod
    def empty(cls) -> SeqColumns:
        ints = np.zeros(0, dtype=np.int64)
        flags = np.zeros(0, dtype=bool)
        floats = np.zeros(0, np.float32)
        sampling = SamplingColumns(floats, floats, ints, np.zeros(0, np.uint64), flags, floats)
        return cls(np.zeros(0, np.uint64), ints, ints, ints, flags, flags, flags, sampling, ints, ints, ints)


def _no_pairs() -> IntArray:
    return np.zeros((0, 2), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class TierCopies:
    """A step's copies between the KV tiers (worker.v1 StepRequest.offloads/onloads),
    whole blocks in every layer, run before anything else in the step: offloads,
    then onloads (worker_svc/kv_offload.py)."""

    offloads: IntArray = field(default_factory=_no_pairs)  # [N, 2] (tier-1 block, tier-2 block)
    onloads: IntArray = field(default_factory=_no_pairs)  # [M, 2] (tier-2 block, tier-1 block)

    def __len__(self) -> int:
        return len(self.offloads) + len(self.onloads)


@dataclass(frozen=True, slots=True)
class StepInput:
    step_id: int
    copies: IntArray  # [C, 2] block copies (src, dst), done before the forward
    seqs: SeqColumns
    # Planned ahead of that step's result: run only right after it (overlapped scheduling).
    previous_step_id: int | None = None
    # The late masks of that step (its SEQ_FLAG_MASK_FOLLOWS rows), riding along with this one.
    previous_step_masks: TokenMasks | None = None
    tiers: TierCopies = field(default_factory=TierCopies)  # done first of all


def ranges(starts: IntArray, lens: IntArray) -> IntArray:
    """Indices of the ranges [starts[i], starts[i] + lens[i]) laid end to end."""
    total = int(lens.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    return np.repeat(starts, lens) + offsets
