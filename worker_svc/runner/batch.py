"""A validated step laid out for one batched forward, on the host (numpy).

Token order: all single-token sequences (decodes) first, then the prefill
chunks, so each layer runs the decode op on one slice and the prefill op on the
other without gathering. With `split_fresh`, chunks that start at position 0
(no cached context) come before the others and form their own group, which
attention may route to SDPA (worker_svc/attention/prefill_route.py).

`plan_batch` builds a `HostBatch` from the step's columns with a few numpy
operations; upload.py moves it to the device in one copy (a `ForwardBatch`).
A decode-only batch can instead be padded (`pad_decode`) into a captured CUDA
graph's persistent buffer (cuda_graphs.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.runner.last_samples import LastSamples
from worker_svc.step.errors import InvalidStep, row_field
from worker_svc.step.input import IntArray, SeqColumns, StepInput, ranges

Int32Array = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class HostGroup:
    """The attention metadata of consecutive sequences, on the host."""

    block_tables: Int32Array  # [S, W], padded with block 0
    context_lens: Int32Array  # [S] cached + new tokens
    cu_query_lens: Int32Array  # [S + 1]


@dataclass(frozen=True, slots=True)
class HostBatch:
    """A step laid out for one forward, in numpy; nothing on the device yet."""

    input_ids: IntArray  # [T]
    positions: IntArray  # [T]
    slot_mapping: IntArray  # [T]
    lora_slots: IntArray  # [T] each token's adapter slot (0: the base model)
    decode: HostGroup | None
    fresh: HostGroup | None  # prefill chunks starting at position 0 (only with split_fresh)
    prefill: HostGroup | None  # the other prefill chunks
    sample_rows: IntArray  # [N] row of the last token of each sampling sequence
    ref_rows: IntArray  # [R] rows whose input is the previous step's sample...
    ref_sources: IntArray  # [R] ...at this row of LastSamples.token_ids
    copies: IntArray  # [2, C] block copies src -> dst, before the forward
    order: IntArray  # [S] the step's rows in batch order
    sample_order: IntArray  # [N] the sampling rows of the step, in batch order
    # Speculative decoding (sampling/verify.py): the sampled rows (of the N) that carry
    # drafts, their draft counts, and the batch rows of every position before their last.
    draft_rows: IntArray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    draft_counts: IntArray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    verify_rows: IntArray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        return self.fresh is None and self.prefill is None


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    """A HostBatch on the device: what the forward and the sampler read."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    lora_slots: torch.Tensor  # [T] int64
    attention: AttentionMetadata
    sample_rows: torch.Tensor  # [N] row in [T] of the last token of each sampling sequence
    copy_src: torch.Tensor | None = None  # [C] int64
    copy_dst: torch.Tensor | None = None
    extra: tuple[torch.Tensor, ...] = ()  # what else the step's upload carried (upload_batch's `extra`)


def check_references(step: StepInput, previous: LastSamples | None) -> IntArray:
    """The row of `previous`'s samples each row that names it takes its input from
    ([R], in step order); InvalidStep when one is not there."""
    seqs = step.seqs
    referring = np.flatnonzero(seqs.from_previous)
    if not referring.size:
        return referring
    if previous is None or previous.step_id != step.previous_step_id:
        sources = np.full(referring.size, -1, dtype=np.int64)
    else:
        sources = previous.rows_of(seqs.seq_ids[referring])
    if (missing := np.flatnonzero(sources < 0)).size:
        row = int(referring[missing[0]])
        raise InvalidStep(
            row_field("flags", row),
            f"SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP: seq_id {seqs.seq_ids[row]} sampled nothing in step "
            f"{step.previous_step_id}",
        )
    return sources


def plan_batch(step: StepInput, split_fresh: bool = False, ref_sources: IntArray | None = None) -> HostBatch:
    """`ref_sources`: check_references's answer for this step (none: the step
    names no previous sample, or the input ids there do not matter)."""
    seqs = step.seqs
    is_decode = seqs.num_tokens == 1
    is_fresh = ~is_decode & (seqs.start_pos == 0) if split_fresh else np.zeros_like(is_decode)
    groups = [np.flatnonzero(is_decode), np.flatnonzero(is_fresh), np.flatnonzero(~is_decode & ~is_fresh)]
    order = np.concatenate(groups)
    lens = seqs.num_tokens[order]
    rows = ranges(seqs.token_starts[order], lens)  # step token index of each batch row
    last_rows = np.cumsum(lens) - 1
    referring = seqs.from_previous[order]
    sources = np.zeros(int(referring.sum()), dtype=np.int64)
    if ref_sources is not None:
        where = np.empty(len(seqs), dtype=np.int64)
        where[np.flatnonzero(seqs.from_previous)] = np.arange(len(ref_sources))
        sources = ref_sources[where[order[referring]]]
    sampled = seqs.sample[order]
    sample_rows = last_rows[sampled]
    counts = seqs.drafts[order][sampled]
    draft_rows = np.flatnonzero(counts)
    return HostBatch(
        input_ids=seqs.token_ids[rows],
        positions=seqs.positions[rows],
        slot_mapping=seqs.slot_mapping[rows],
        lora_slots=np.repeat(seqs.adapter_slots[order], lens),
        decode=_group(seqs, groups[0]),
        fresh=_group(seqs, groups[1]),
        prefill=_group(seqs, groups[2]),
        sample_rows=sample_rows,
        ref_rows=last_rows[referring],
        ref_sources=sources,
        copies=np.ascontiguousarray(step.copies.T),
        order=order,
        sample_order=order[sampled],
        draft_rows=draft_rows,
        draft_counts=counts[draft_rows],
        verify_rows=ranges(sample_rows[draft_rows] - counts[draft_rows], counts[draft_rows]),
    )


def _group(seqs: SeqColumns, members: IntArray) -> HostGroup | None:
    """The attention metadata of the rows `members` (indices into the step), in that order."""
    if members.size == 0:
        return None
    table_lens = seqs.table_lens[members]
    tables = np.zeros((members.size, int(table_lens.max())), dtype=np.int32)
    row_of = np.repeat(np.arange(members.size), table_lens)
    columns = ranges(np.zeros_like(table_lens), table_lens)
    tables[row_of, columns] = seqs.block_tables[ranges(seqs.table_starts[members], table_lens)]
    cu = np.concatenate([[0], np.cumsum(seqs.num_tokens[members])]).astype(np.int32)
    return HostGroup(tables, seqs.context_lens[members].astype(np.int32), cu)


def pad_decode(host: HostBatch, size: int, table_width: int) -> HostBatch:
    """A decode-only batch padded to `size` rows with tables `table_width` wide (a
    captured graph's shapes). A padding row writes nothing (slot -1: write_kv skips
    it, so no block of any sequence changes) and attends to one position of block
    0 (context 1): a read of finite data (the pool starts zeroed and only ever
    holds written K/V) whose result no one samples. Real rows keep their indices,
    so sample_rows and the references stay valid."""
    assert host.decode is not None and host.decode_only, "only decode-only batches are padded"
    n, width = host.num_tokens, host.decode.block_tables.shape[1]
    assert n <= size and width <= table_width, (n, size, width, table_width)
    pad = size - n
    tables = np.zeros((size, table_width), dtype=np.int32)
    tables[:n, :width] = host.decode.block_tables
    decode = HostGroup(
        tables,
        np.concatenate([host.decode.context_lens, np.ones(pad, dtype=np.int32)]),
        np.arange(size + 1, dtype=np.int32),
    )
    return dataclasses.replace(
        host,
        input_ids=np.concatenate([host.input_ids, np.zeros(pad, dtype=np.int64)]),
        positions=np.concatenate([host.positions, np.zeros(pad, dtype=np.int64)]),
        slot_mapping=np.concatenate([host.slot_mapping, np.full(pad, -1, dtype=np.int64)]),
        lora_slots=np.concatenate([host.lora_slots, np.zeros(pad, dtype=np.int64)]),
        decode=decode,
    )
