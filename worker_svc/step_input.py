"""What a Step asks for, as plain data (converted from proto in server.py), and
its validation: a step that fails here touches nothing.

A step's numbers also live as flat arrays (`StepArrays`: every sequence's
tokens, slots and block table end to end), so validation and batch building
are a few numpy operations per step, not Python loops over tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


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
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives returned with the sampled token
    # Logit processing (in this order): -inf, + bias, penalties.
    blocked_token_ids: Sequence[int] = ()
    logit_bias_token_ids: Sequence[int] = ()
    logit_bias_values: Sequence[float] = ()
    penalties: Penalties | None = None

    @property
    def processes_logits(self) -> bool:
        return bool(len(self.blocked_token_ids) or len(self.logit_bias_token_ids) or self.penalties)


@dataclass(slots=True)
class SeqInput:
    seq_id: int
    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    slot_mapping: Sequence[int]
    sample: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_logits: bool = False
    # The input is the token this sequence sampled in the previous step (token_ids holds a placeholder).
    token_from_previous_step: bool = False
    # Prompt logprobs: the token after each of the first len(...) positions of this chunk.
    prompt_logprob_targets: Sequence[int] = ()
    prompt_top_logprobs: int = 0

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class StepArrays:
    """The step's sequences end to end, in step order (all int64)."""

    token_ids: np.ndarray  # [T]
    seq_lens: np.ndarray  # [S] tokens per sequence
    start_pos: np.ndarray  # [S]
    slot_mapping: np.ndarray  # [sum(slot_lens)]
    slot_lens: np.ndarray  # [S] (validated to equal seq_lens; from the wire they are seq_lens)
    block_tables: np.ndarray  # [sum(table_lens)]
    table_lens: np.ndarray  # [S]

    @classmethod
    def from_seqs(cls, seqs: Sequence[SeqInput]) -> StepArrays:
        return cls(
            token_ids=_flat([s.token_ids for s in seqs]),
            seq_lens=np.array([len(s.token_ids) for s in seqs], dtype=np.int64),
            start_pos=np.array([s.start_pos for s in seqs], dtype=np.int64),
            slot_mapping=_flat([s.slot_mapping for s in seqs]),
            slot_lens=np.array([len(s.slot_mapping) for s in seqs], dtype=np.int64),
            block_tables=_flat([s.block_table for s in seqs]),
            table_lens=np.array([len(s.block_table) for s in seqs], dtype=np.int64),
        )

    @property
    def context_lens(self) -> np.ndarray:
        return self.start_pos + self.seq_lens

    @property
    def positions(self) -> np.ndarray:
        """[T]: each token's position in its sequence."""
        return np.repeat(self.start_pos, self.seq_lens) + _offsets_within(self.seq_lens)


@dataclass(slots=True)
class StepInput:
    step_id: int
    copies: list[tuple[int, int]]
    seqs: list[SeqInput]
    _arrays: StepArrays | None = None
    # Planned ahead of that step's result: run only right after it (overlapped scheduling).
    previous_step_id: int | None = None

    @property
    def arrays(self) -> StepArrays:
        if self._arrays is None:
            self._arrays = StepArrays.from_seqs(self.seqs)
        return self._arrays


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    num_blocks: int  # ids a block table may name: blocks, or the slots of a contiguous cache
    block_size: int  # tokens per id: a contiguous slot holds max_seq_len
    max_model_len: int
    kv_layout: str = "paged"  # contiguous: a block table is exactly [slot]


class InvalidStep(ValueError):
    """A malformed step; `field` names the offending request field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class StaleStep(RuntimeError):
    """A step planned ahead names a previous step that is not the one this worker
    ran last (it restarted, or that step failed): its inputs cannot be resolved."""


def ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Indices of the ranges [starts[i], starts[i] + lens[i]) laid end to end."""
    return np.repeat(starts, lens) + _offsets_within(lens)


def _offsets_within(lens: np.ndarray) -> np.ndarray:
    """0..lens[i]-1 for each i, end to end."""
    total = int(lens.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)


def _flat(parts: Sequence[Sequence[int]]) -> np.ndarray:
    flat: list[int] = []
    for part in parts:
        flat.extend(part)
    return np.array(flat, dtype=np.int64)


def row_field(column: str, row: int) -> str:
    """How an error names a row of a column (or of its flat slice): `seqs.token_ids[row 3]`."""
    return f"seqs.{column}[row {row}]"


def check_columns(
    rows: int,
    per_row: Mapping[str, int],
    flat: Mapping[str, tuple[int, str, np.ndarray]],
    flags: np.ndarray,
    known_flags: int,
    extras_rows: Iterable[int],
) -> None:
    """The wire's columns agree before any is read: every per-row column has one
    entry per row (`per_row`: column -> entries), every flat column as many as
    its counts sum to (`flat`: column -> (entries, counts column, counts)), no
    row sets an unknown flag, and extras name existing rows."""
    for name, entries in per_row.items():
        if entries != rows:
            raise InvalidStep(f"seqs.{name}", f"{entries} entries for {rows} rows (one per seqs.seq_ids entry)")
    for name, (entries, counts_name, counts) in flat.items():
        if entries != (total := int(counts.sum())):
            raise InvalidStep(f"seqs.{name}", f"{entries} entries, but the rows' seqs.{counts_name} sum to {total}")
    if (i := _first(flags & ~known_flags)) is not None:
        raise InvalidStep(row_field("flags", i), f"unknown bits {int(flags[i]) & ~known_flags:#x}")
    if stray := sorted(row for row in extras_rows if row >= rows):
        raise InvalidStep(f"seqs.extras[row {stray[0]}]", f"no such row ({rows} rows)")


def validate(step: StepInput, limits: Limits) -> None:
    if not step.seqs and not step.copies:
        raise InvalidStep("seqs", "a step needs at least one sequence or block copy")
    _validate_copies(step.copies, limits)
    if step.seqs:
        _validate_seqs(step, limits)


def _validate_copies(copies: list[tuple[int, int]], limits: Limits) -> None:
    dsts = set()
    for i, (src, dst) in enumerate(copies):
        for name, block in (("src", src), ("dst", dst)):
            if not 0 <= block < limits.num_blocks:
                raise InvalidStep(f"copies[{i}].{name}", f"block {block} outside [0, {limits.num_blocks})")
        if src == dst or dst in dsts:
            raise InvalidStep(f"copies[{i}].dst", f"block {dst} is copied onto twice or onto itself")
        dsts.add(dst)
    if dsts & {src for src, _ in copies}:
        raise InvalidStep("copies", "a block is both a copy source and a copy destination")


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _seq_of(flat_index: int, lens: np.ndarray) -> int:
    """Which sequence the element at `flat_index` of an end-to-end array belongs to."""
    return int(np.searchsorted(np.cumsum(lens), flat_index, side="right"))


def _validate_seqs(step: StepInput, limits: Limits) -> None:
    a = step.arrays
    ids = [s.seq_id for s in step.seqs]
    if len(set(ids)) != len(ids):
        seen: set[int] = set()
        for i, seq_id in enumerate(ids):
            if seq_id in seen:
                raise InvalidStep(row_field("seq_ids", i), f"seq_id {seq_id} appears twice in one step")
            seen.add(seq_id)
    if (i := _first(a.seq_lens == 0)) is not None:
        raise InvalidStep(row_field("token_ids", i), "empty (num_tokens 0)")
    if (i := _first(a.start_pos < 0)) is not None:
        raise InvalidStep(row_field("start_pos", i), f"negative ({a.start_pos[i]})")
    context = a.context_lens
    if (i := _first(context > limits.max_model_len)) is not None:
        raise InvalidStep(
            row_field("start_pos", i),
            f"start_pos + num_tokens = {context[i]} exceeds max model length {limits.max_model_len}",
        )
    if (t := _first((a.token_ids < 0) | (a.token_ids >= limits.vocab_size))) is not None:
        raise InvalidStep(
            row_field("token_ids", _seq_of(t, a.seq_lens)),
            f"token id {a.token_ids[t]} outside the vocabulary [0, {limits.vocab_size})",
        )
    _validate_tables(a, context, limits)
    if (i := _first(a.slot_lens != a.seq_lens)) is not None:
        raise InvalidStep(row_field("slot_mapping", i), f"{a.slot_lens[i]} slots for {a.seq_lens[i]} tokens")
    _validate_slots(a, limits.block_size)
    for i, seq in enumerate(step.seqs):
        s = seq.sampling
        if seq.sample and not (s.temperature >= 0 and 0 <= s.top_p <= 1 and s.top_k >= 0):
            _reject_sampling(i, s)
        if seq.sample and (s.top_logprobs or s.processes_logits):
            _validate_logit_processing(row_field("extras", i), s, limits.vocab_size)
        if len(seq.prompt_logprob_targets) or seq.prompt_top_logprobs:
            _validate_prompt_logprobs(i, seq, limits.vocab_size)
        if seq.token_from_previous_step and (len(seq.token_ids) != 1 or step.previous_step_id is None):
            raise InvalidStep(
                row_field("flags", i),
                "SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP needs exactly one (placeholder) token and the step's "
                "previous_step_id",
            )


def _validate_tables(a: StepArrays, context: np.ndarray, limits: Limits) -> None:
    if limits.kv_layout == "contiguous" and (i := _first(a.table_lens != 1)) is not None:
        raise InvalidStep(
            row_field("block_tables", i),
            f"a contiguous cache takes exactly one slot per sequence ([slot]), got {a.table_lens[i]} entries",
        )
    needed = -(-context // limits.block_size)
    if (i := _first(a.table_lens < needed)) is not None:
        raise InvalidStep(
            row_field("block_tables", i), f"{a.table_lens[i]} blocks cannot hold {context[i]} tokens (need {needed[i]})"
        )
    if (b := _first((a.block_tables < 0) | (a.block_tables >= limits.num_blocks))) is not None:
        raise InvalidStep(
            row_field("block_tables", _seq_of(b, a.table_lens)),
            f"block {a.block_tables[b]} outside [0, {limits.num_blocks})",
        )


def _validate_slots(a: StepArrays, block_size: int) -> None:
    """A slot must be where the block table says the token lives, or attention
    would read other data than was written (and could clobber a shared block).
    A negative slot means "don't write"."""
    positions = a.positions
    table_starts = np.cumsum(a.table_lens) - a.table_lens
    blocks = a.block_tables[np.repeat(table_starts, a.seq_lens) + positions // block_size]
    expected = blocks * block_size + positions % block_size
    if (t := _first((a.slot_mapping >= 0) & (a.slot_mapping != expected))) is not None:
        raise InvalidStep(
            row_field("slot_mapping", _seq_of(t, a.seq_lens)),
            f"slot {a.slot_mapping[t]} for position {positions[t]} does not match the block table",
        )


def _check_ids(field_name: str, ids: Sequence[int], vocab_size: int) -> None:
    values = np.asarray(ids, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        raise InvalidStep(field_name, f"token ids must be in the vocabulary [0, {vocab_size})")


def _reject_sampling(row: int, s: Sampling) -> None:
    if not s.temperature >= 0:
        raise InvalidStep(row_field("temperature", row), f"must be >= 0, got {s.temperature}")
    if not 0 <= s.top_p <= 1:
        raise InvalidStep(row_field("top_p", row), f"must be in [0, 1], got {s.top_p}")
    raise InvalidStep(row_field("top_k", row), f"must be >= 0, got {s.top_k}")


def _validate_logit_processing(field_name: str, s: Sampling, vocab_size: int) -> None:
    if not 0 <= s.top_logprobs <= vocab_size:
        raise InvalidStep(f"{field_name}.top_logprobs", f"must be in [0, {vocab_size}], got {s.top_logprobs}")
    _check_ids(f"{field_name}.blocked_token_ids", s.blocked_token_ids, vocab_size)
    _check_ids(f"{field_name}.logit_bias_token_ids", s.logit_bias_token_ids, vocab_size)
    if len(s.logit_bias_token_ids) != len(s.logit_bias_values) or not np.isfinite(s.logit_bias_values).all():
        raise InvalidStep(f"{field_name}.logit_bias_values", "one finite value per logit_bias_token_ids entry")
    p = s.penalties
    if p is None:
        return
    if not (np.isfinite([p.presence, p.frequency, p.repetition]).all() and p.repetition > 0):
        raise InvalidStep(f"{field_name}.penalties", "need finite presence and frequency, repetition > 0")
    _check_ids(f"{field_name}.penalties.output_token_ids", p.output_token_ids, vocab_size)
    _check_ids(f"{field_name}.penalties.prompt_token_ids", p.prompt_token_ids, vocab_size)


def _validate_prompt_logprobs(row: int, seq: SeqInput, vocab_size: int) -> None:
    field_name = row_field("extras", row)
    if len(seq.prompt_logprob_targets) > len(seq.token_ids):
        raise InvalidStep(
            f"{field_name}.prompt_logprob_targets",
            f"{len(seq.prompt_logprob_targets)} targets for a chunk of {len(seq.token_ids)} positions",
        )
    _check_ids(f"{field_name}.prompt_logprob_targets", seq.prompt_logprob_targets, vocab_size)
    if not 0 <= seq.prompt_top_logprobs <= vocab_size:
        raise InvalidStep(
            f"{field_name}.prompt_top_logprobs", f"must be in [0, {vocab_size}], got {seq.prompt_top_logprobs}"
        )
