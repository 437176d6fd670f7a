"""A step's validation: a step that fails here touches nothing. Every check is a
few numpy operations over whole columns; only the rows with extras are looked at
one by one. Errors name the column and the row (InvalidStep)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from worker_svc.step.errors import InvalidStep, row_field
from worker_svc.step.input import IntArray, RowExtras, SeqColumns, StepInput, TierCopies, TokenMasks

_MAX_POOLING = 2  # worker.v1 Pooling: NONE, LAST, SUM


@dataclass(frozen=True, slots=True)
class Limits:
    vocab_size: int
    num_blocks: int  # ids a block table may name: blocks, or the slots of a contiguous cache
    block_size: int  # tokens per id: a contiguous slot holds max_seq_len
    max_model_len: int
    kv_layout: str = "paged"  # contiguous: a block table is exactly [slot]
    num_offload_blocks: int = 0  # the second tier's ids (--kv-offload-gb); 0: none


def check_columns(
    rows: int,
    per_row: Mapping[str, int],
    flat: Mapping[str, tuple[int, str, IntArray]],
    flags: IntArray,
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
    if not len(step.seqs) and not len(step.copies) and not len(step.tiers):
        raise InvalidStep("seqs", "a step needs at least one sequence, block copy or tier copy")
    _validate_copies(step.copies, limits)
    _validate_tier_copies(step.tiers, limits)
    if len(step.seqs):
        _validate_seqs(step.seqs, step.previous_step_id, limits)


def _validate_copies(copies: IntArray, limits: Limits) -> None:
    if not copies.size:  # most steps
        return
    for column, name in ((0, "src"), (1, "dst")):
        if (i := _first((copies[:, column] < 0) | (copies[:, column] >= limits.num_blocks))) is not None:
            raise InvalidStep(f"copies[{i}].{name}", f"block {copies[i, column]} outside [0, {limits.num_blocks})")
    src, dst = copies[:, 0], copies[:, 1]
    _, first_of = np.unique(dst, return_index=True)
    repeated = np.ones(len(dst), dtype=bool)
    repeated[first_of] = False
    if (i := _first((src == dst) | repeated)) is not None:
        raise InvalidStep(f"copies[{i}].dst", f"block {dst[i]} is copied onto twice or onto itself")
    if np.isin(dst, src).any():
        raise InvalidStep("copies", "a block is both a copy source and a copy destination")


def _validate_tier_copies(tiers: TierCopies, limits: Limits) -> None:
    if not len(tiers):  # most steps
        return
    if not limits.num_offload_blocks:
        raise InvalidStep("offloads" if len(tiers.offloads) else "onloads", "this worker has no second KV tier")
    tier1, tier2 = limits.num_blocks, limits.num_offload_blocks
    for name, pairs, limits_by_end in (
        ("offloads", tiers.offloads, (tier1, tier2)),
        ("onloads", tiers.onloads, (tier2, tier1)),
    ):
        for column, (end, limit) in enumerate(zip(("src", "dst"), limits_by_end)):
            if (i := _first((pairs[:, column] < 0) | (pairs[:, column] >= limit))) is not None:
                raise InvalidStep(f"{name}[{i}].{end}", f"block {pairs[i, column]} outside [0, {limit})")
        if len(np.unique(pairs[:, 1])) != len(pairs):
            raise InvalidStep(f"{name}", "a block is copied onto twice")


def _first(mask: npt.NDArray[np.bool_] | IntArray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def _row_of(flat_index: int, lens: IntArray) -> int:
    """Which row the element at `flat_index` of an end-to-end column belongs to."""
    return int(np.searchsorted(np.cumsum(lens), flat_index, side="right"))


def _validate_seqs(seqs: SeqColumns, previous_step_id: int | None, limits: Limits) -> None:
    ids = seqs.seq_ids
    ordered = np.sort(ids)
    if (ordered[1:] == ordered[:-1]).any():
        _, first_of = np.unique(ids, return_index=True)
        repeated = np.ones(ids.size, dtype=bool)
        repeated[first_of] = False
        again = int(np.flatnonzero(repeated)[0])
        raise InvalidStep(row_field("seq_ids", again), f"seq_id {ids[again]} appears twice in one step")
    if (i := _first(seqs.num_tokens == 0)) is not None:
        raise InvalidStep(row_field("token_ids", i), "empty (num_tokens 0)")
    if (i := _first(seqs.start_pos < 0)) is not None:
        raise InvalidStep(row_field("start_pos", i), f"negative ({seqs.start_pos[i]})")
    context = seqs.context_lens
    if (i := _first(context > limits.max_model_len)) is not None:
        raise InvalidStep(
            row_field("start_pos", i),
            f"start_pos + num_tokens = {context[i]} exceeds max model length {limits.max_model_len}",
        )
    tokens = seqs.token_ids
    if (t := _first((tokens < 0) | (tokens >= limits.vocab_size))) is not None:
        raise InvalidStep(
            row_field("token_ids", _row_of(t, seqs.num_tokens)),
            f"token id {tokens[t]} outside the vocabulary [0, {limits.vocab_size})",
        )
    _validate_tables(seqs, context, limits)
    _validate_slots(seqs, limits.block_size)
    _validate_sampling(seqs)
    wrong_previous = seqs.from_previous & ((seqs.num_tokens != 1) | (previous_step_id is None))
    if (i := _first(wrong_previous)) is not None:
        raise InvalidStep(
            row_field("flags", i),
            "SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP needs exactly one (placeholder) token and the step's previous_step_id",
        )
    _validate_drafts(seqs)
    if len(seqs.pooling):
        _validate_pooling(seqs)
    if seqs.masks is not None or seqs.late_mask_rows.size:
        _validate_mask_rows(seqs, limits.vocab_size)
    if seqs.masks is not None or seqs.draft_masks is not None:
        _validate_draft_masks(seqs, limits.vocab_size)
    for row, extras in sorted(seqs.extras.items()):
        if seqs.sample[row] and (extras.top_logprobs or extras.processes_logits):
            _validate_logit_processing(row_field("extras", row), extras, limits.vocab_size)
        if len(extras.prompt_logprob_targets) or extras.prompt_top_logprobs:
            _validate_prompt_logprobs(row, extras, int(seqs.num_tokens[row]), limits.vocab_size)


def _validate_drafts(seqs: SeqColumns) -> None:
    """Drafts (speculative decoding) only where verification samples every position
    as one-token decoding would (sampling/verify.py): a sampling row, greedy or not,
    whose chunk holds its input and the drafts, with blocked ids, a logit bias or
    penalties at most (applied per position); nothing that reports more than the
    token (returned logits, alternatives, prompt logprobs) and no late mask (a drafting
    row's masks come with it: _validate_draft_masks)."""
    if not len(seqs.num_drafts):
        return
    drafts = seqs.num_drafts
    if (i := _first((drafts < 0) | (drafts >= seqs.num_tokens))) is not None:
        raise InvalidStep(
            row_field("num_drafts", i), f"{drafts[i]} drafts in a chunk of {seqs.num_tokens[i]} tokens (at most n - 1)"
        )
    unverifiable = ~seqs.sample | seqs.from_previous | seqs.return_logits
    if (i := _first((drafts > 0) & unverifiable)) is not None:
        raise InvalidStep(
            row_field("num_drafts", i), "drafts need a sampling row, its input in token_ids, no returned logits"
        )
    late = seqs.late_mask_rows
    if (i := _first(drafts[late] > 0)) is not None:
        raise InvalidStep(row_field("num_drafts", int(late[i])), "drafts cannot be verified under a late mask")
    for row, e in seqs.extras.items():
        if drafts[row] and (e.top_logprobs or len(e.prompt_logprob_targets)):
            raise InvalidStep(
                row_field("num_drafts", row), "drafts cannot be verified with top_logprobs or prompt logprobs"
            )


def _validate_tables(seqs: SeqColumns, context: IntArray, limits: Limits) -> None:
    table_lens = seqs.table_lens
    if limits.kv_layout == "contiguous" and (i := _first(table_lens != 1)) is not None:
        raise InvalidStep(
            row_field("block_tables", i),
            f"a contiguous cache takes exactly one slot per sequence ([slot]), got {table_lens[i]} entries",
        )
    needed = -(-context // limits.block_size)
    if (i := _first(table_lens < needed)) is not None:
        raise InvalidStep(
            row_field("block_tables", i), f"{table_lens[i]} blocks cannot hold {context[i]} tokens (need {needed[i]})"
        )
    tables = seqs.block_tables
    if (b := _first((tables < 0) | (tables >= limits.num_blocks))) is not None:
        raise InvalidStep(
            row_field("block_tables", _row_of(b, table_lens)), f"block {tables[b]} outside [0, {limits.num_blocks})"
        )


def _validate_slots(seqs: SeqColumns, block_size: int) -> None:
    """A slot must be where the block table says the token lives, or attention
    would read other data than was written (and could clobber a shared block).
    A negative slot means "don't write"."""
    positions = seqs.positions
    blocks = seqs.block_tables[np.repeat(seqs.table_starts, seqs.num_tokens) + positions // block_size]
    expected = blocks * block_size + positions % block_size
    slots = seqs.slot_mapping
    if (t := _first((slots >= 0) & (slots != expected))) is not None:
        raise InvalidStep(
            row_field("slot_mapping", _row_of(t, seqs.num_tokens)),
            f"slot {slots[t]} for position {positions[t]} does not match the block table",
        )


def _validate_sampling(seqs: SeqColumns) -> None:
    """Temperature >= 0, top-p and min-p in [0, 1], top-k >= 0 on the sampling rows (NaN fails)."""
    s = seqs.sampling
    checks = (
        ("temperature", s.temperature >= 0, "must be >= 0"),
        ("top_p", (s.top_p >= 0) & (s.top_p <= 1), "must be in [0, 1]"),
        ("top_k", s.top_k >= 0, "must be >= 0"),
        ("min_p", (s.min_p >= 0) & (s.min_p <= 1), "must be in [0, 1]"),
    )
    if not (seqs.sample & ~np.logical_and.reduce([ok for _, ok, _ in checks])).any():
        return
    for column, ok, rule in checks:
        if (i := _first(seqs.sample & ~ok)) is not None:
            raise InvalidStep(row_field(column, i), f"{rule}, got {getattr(s, column)[i]}")


def _check_ids(field_name: str, ids: Sequence[int], vocab_size: int) -> None:
    values = np.asarray(ids, dtype=np.int64)
    if values.size and (values.min() < 0 or values.max() >= vocab_size):
        raise InvalidStep(field_name, f"token ids must be in the vocabulary [0, {vocab_size})")


def _validate_logit_processing(field_name: str, e: RowExtras, vocab_size: int) -> None:
    if not 0 <= e.top_logprobs <= vocab_size:
        raise InvalidStep(f"{field_name}.top_logprobs", f"must be in [0, {vocab_size}], got {e.top_logprobs}")
    _check_ids(f"{field_name}.blocked_token_ids", e.blocked_token_ids, vocab_size)
    _check_ids(f"{field_name}.logit_bias_token_ids", e.logit_bias_token_ids, vocab_size)
    if len(e.logit_bias_token_ids) != len(e.logit_bias_values) or not np.isfinite(e.logit_bias_values).all():
        raise InvalidStep(f"{field_name}.logit_bias_values", "one finite value per logit_bias_token_ids entry")
    p = e.penalties
    if p is None:
        return
    if not (np.isfinite([p.presence, p.frequency, p.repetition]).all() and p.repetition > 0):
        raise InvalidStep(f"{field_name}.penalties", "need finite presence and frequency, repetition > 0")
    _check_ids(f"{field_name}.penalties.output_token_ids", p.output_token_ids, vocab_size)
    _check_ids(f"{field_name}.penalties.prompt_token_ids", p.prompt_token_ids, vocab_size)


def _validate_pooling(seqs: SeqColumns) -> None:
    """A pooling row names a known reduction of its own chunk: its input is in
    token_ids (not the previous step's sample) and it verifies no drafts."""
    pooling = seqs.pooling
    if (i := _first((pooling < 0) | (pooling > _MAX_POOLING))) is not None:
        raise InvalidStep(row_field("pooling", i), f"unknown pooling {pooling[i]}")
    if (i := _first((pooling != 0) & (seqs.from_previous | (seqs.drafts > 0)))) is not None:
        raise InvalidStep(
            row_field("pooling", i), "a pooling row takes neither SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP nor drafts"
        )


def _validate_prompt_logprobs(row: int, e: RowExtras, num_tokens: int, vocab_size: int) -> None:
    field_name = row_field("extras", row)
    if len(e.prompt_logprob_targets) > num_tokens:
        raise InvalidStep(
            f"{field_name}.prompt_logprob_targets",
            f"{len(e.prompt_logprob_targets)} targets for a chunk of {num_tokens} positions",
        )
    _check_ids(f"{field_name}.prompt_logprob_targets", e.prompt_logprob_targets, vocab_size)
    if not 0 <= e.prompt_top_logprobs <= vocab_size:
        raise InvalidStep(
            f"{field_name}.prompt_top_logprobs", f"must be in [0, {vocab_size}], got {e.prompt_top_logprobs}"
        )


# ---- structured outputs: token masks ----------------------------------------------------------


def mask_width(vocab_size: int) -> int:
    """int32 words of one mask row: ceil(vocab / 32) (the scheduler's rule, bitmask.py)."""
    return (vocab_size + 31) // 32


def check_mask_shape(field_name: str, rows: int, width: int, num_bytes: int) -> None:
    """A TokenMasks message holds rows x width int32 words, before they are read."""
    if num_bytes != 4 * rows * width:
        raise InvalidStep(
            f"{field_name}.words",
            f"{num_bytes} bytes, but {rows} rows x width_words {width} x 4 bytes = {4 * rows * width}",
        )


def validate_masks(field_name: str, masks: TokenMasks, vocab_size: int) -> None:
    """The width is this worker's, and every row allows some token of its vocabulary."""
    width = masks.words.shape[1]
    if width != (want := mask_width(vocab_size)):
        raise InvalidStep(
            f"{field_name}.width_words",
            f"{width} words per row; a vocabulary of {vocab_size} ids takes ceil({vocab_size} / 32) = {want}",
        )
    if not len(masks):
        return
    valid = masks.words.copy()
    valid[:, -1] &= np.int32(-1) if vocab_size % 32 == 0 else np.int32((1 << (vocab_size % 32)) - 1)
    if (i := _first(np.all(valid == 0, axis=1))) is not None:
        raise InvalidStep(f"{field_name}.words", f"the mask of row {masks.rows[i]} allows no token")


def _validate_mask_rows(seqs: SeqColumns, vocab_size: int) -> None:
    """Masks belong to sampling rows, each row's once (inline or late); inline rows ascending."""
    late = seqs.late_mask_rows
    if (i := _first(~seqs.sample[late])) is not None:
        raise InvalidStep(row_field("flags", int(late[i])), "SEQ_FLAG_MASK_FOLLOWS on a row that samples nothing")
    if seqs.masks is None:
        return
    rows = seqs.masks.rows
    bad = (rows < 0) | (rows >= len(seqs))
    bad[1:] |= rows[1:] <= rows[:-1]
    if (i := _first(bad)) is not None:
        raise InvalidStep(f"seqs.masks.rows[{i}]", f"row {rows[i]}: rows must be ascending and in [0, {len(seqs)})")
    if (i := _first(~seqs.sample[rows])) is not None:
        raise InvalidStep(f"seqs.masks.rows[{i}]", f"row {rows[i]} samples nothing")
    if (i := _first(np.isin(rows, late))) is not None:
        raise InvalidStep(
            f"seqs.masks.rows[{i}]", f"row {rows[i]} is flagged SEQ_FLAG_MASK_FOLLOWS: its mask comes in StepMasks"
        )
    validate_masks("seqs.masks", seqs.masks, vocab_size)


def _validate_draft_masks(seqs: SeqColumns, vocab_size: int) -> None:
    """The inner positions' masks: each drafting row in seqs.masks, num_drafts times, in
    row order (a masked row's every verified position is masked, an unmasked row's none)."""
    none = np.zeros(0, dtype=np.int64)
    inline = seqs.masks.rows if seqs.masks is not None else none
    drafts = seqs.drafts
    masked = inline[drafts[inline] > 0]
    want = np.repeat(masked, drafts[masked])
    got = seqs.draft_masks.rows if seqs.draft_masks is not None else none
    if not np.array_equal(got, want):
        n = min(len(got), len(want))
        i = _first(got[:n] != want[:n])
        raise InvalidStep(
            f"seqs.draft_masks.rows[{n if i is None else i}]",
            f"rows {got.tolist()}, but the drafting rows in seqs.masks, each once per draft, are {want.tolist()}",
        )
    if seqs.draft_masks is not None:
        validate_masks("seqs.draft_masks", seqs.draft_masks, vocab_size)


def check_late_rows(field_name: str, step_id: int, masks: TokenMasks, expected_rows: IntArray) -> None:
    """Late masks (a StepMasks call's, or the next step's previous_step_masks: `field_name`) are
    those of exactly the step's SEQ_FLAG_MASK_FOLLOWS rows (their width and contents were checked
    when they came: validate_masks)."""
    if not np.array_equal(masks.rows, expected_rows):
        raise InvalidStep(
            f"{field_name}.rows",
            f"{masks.rows.tolist()}, but the SEQ_FLAG_MASK_FOLLOWS rows of step {step_id} are {expected_rows.tolist()}",
        )
