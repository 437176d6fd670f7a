"""Flatten a validated step into the tensors one batched forward needs.

Token order: all single-token sequences (decodes) first, then the prefill
chunks, so each layer runs the decode op on one slice and the prefill op on the
other without gathering. With `split_fresh`, chunks that start at position 0
(no cached context) come before the others and form their own group, which
attention may route to SDPA (worker_svc/attention.py).

The step is laid out on the host first (`plan_batch`: numpy, a `HostBatch`),
then every integer tensor of it crosses to the device in one copy
(`upload_batch` through an `InputUploader`). A decode-only batch can instead be
padded into a captured CUDA graph's persistent buffer (worker_svc/cuda_graphs.py):
the same packing, into a fixed device buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.step_input import InvalidStep, SeqInput, StepArrays, StepInput, ranges, row_field

if TYPE_CHECKING:
    from worker_svc.model_runner import LastSamples


@dataclass
class HostGroup:
    """The attention metadata of consecutive sequences, on the host."""

    block_tables: np.ndarray  # [S, W] int32, padded with block 0
    context_lens: np.ndarray  # [S] int32: cached + new tokens
    cu_query_lens: np.ndarray  # [S + 1] int32

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class HostBatch:
    """A step laid out for one forward, in numpy; nothing on the device yet."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    decode: HostGroup | None
    fresh: HostGroup | None  # prefill chunks starting at position 0 (only with split_fresh)
    prefill: HostGroup | None  # the other prefill chunks
    sample_rows: np.ndarray  # [N] int64: row of the last token of each sampling sequence
    ref_rows: np.ndarray  # [R] int64: rows whose input is the previous step's sample...
    ref_sources: np.ndarray  # [R] int64: ...at this row of LastSamples.token_ids
    copies: np.ndarray  # [2, C] int64: block copies src -> dst, before the forward
    seqs: list[SeqInput]  # in token order
    sample_seqs: list[SeqInput]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def decode_only(self) -> bool:
        return self.fresh is None and self.prefill is None


@dataclass
class AttentionGroup:
    block_tables: torch.Tensor  # [S, W] int32, padded with block 0
    context_lens: torch.Tensor  # [S] int32: cached + new tokens
    cu_query_lens: torch.Tensor  # [S + 1] int32
    num_tokens: int
    query_lens: tuple[int, ...]  # host copy of the query lengths (the SDPA route loops over them)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] int64
    decode: AttentionGroup | None
    prefill: AttentionGroup | None
    seqs: list[SeqInput]  # in token order
    sample_rows: torch.Tensor  # row in [T] of the last token of each sampling sequence
    sample_seqs: list[SeqInput]
    fresh: AttentionGroup | None = None  # between decode and prefill rows
    copy_src: torch.Tensor | None = None  # [C] int64
    copy_dst: torch.Tensor | None = None


def plan_batch(step: StepInput, split_fresh: bool = False) -> HostBatch:
    a = step.arrays
    is_decode = a.seq_lens == 1
    is_fresh = ~is_decode & (a.start_pos == 0) if split_fresh else np.zeros_like(is_decode)
    groups = [np.flatnonzero(is_decode), np.flatnonzero(is_fresh), np.flatnonzero(~is_decode & ~is_fresh)]
    order = np.concatenate(groups)
    token_starts = np.cumsum(a.seq_lens) - a.seq_lens
    rows = ranges(token_starts[order], a.seq_lens[order])  # step token index of each batch row
    seqs = [step.seqs[i] for i in order]
    samples = np.array([s.sample for s in seqs], dtype=bool)
    last_rows = np.cumsum(a.seq_lens[order]) - 1
    referring = np.array([k for k, seq in enumerate(seqs) if seq.token_from_previous_step], dtype=np.int64)
    copies = np.array(step.copies, dtype=np.int64).reshape(-1, 2).T
    return HostBatch(
        input_ids=a.token_ids[rows],
        positions=a.positions[rows],
        slot_mapping=a.slot_mapping[rows],
        decode=_group(a, groups[0]),
        fresh=_group(a, groups[1]),
        prefill=_group(a, groups[2]),
        sample_rows=last_rows[samples],
        ref_rows=last_rows[referring],
        ref_sources=np.zeros(len(referring), dtype=np.int64),  # filled by resolve_references
        copies=np.ascontiguousarray(copies),
        seqs=seqs,
        sample_seqs=[s for s in seqs if s.sample],
    )


def resolve_references(host: HostBatch, previous: LastSamples | None) -> None:
    """The row of the previous step's samples each referring decode takes its input from."""
    if host.ref_rows.size and previous is not None:
        referring = [seq for seq in host.seqs if seq.token_from_previous_step]
        host.ref_sources = np.array([previous.rows[seq.seq_id] for seq in referring], dtype=np.int64)


def _group(a: StepArrays, members: np.ndarray) -> HostGroup | None:
    """The attention metadata of the sequences `members` (indices into the step), in that order."""
    if members.size == 0:
        return None
    table_lens = a.table_lens[members]
    table_starts = (np.cumsum(a.table_lens) - a.table_lens)[members]
    tables = np.zeros((members.size, int(table_lens.max())), dtype=np.int32)
    row_of = np.repeat(np.arange(members.size), table_lens)
    tables[row_of, ranges(np.zeros_like(table_lens), table_lens)] = a.block_tables[ranges(table_starts, table_lens)]
    cu = np.concatenate([[0], np.cumsum(a.seq_lens[members])]).astype(np.int32)
    return HostGroup(tables, a.context_lens[members].astype(np.int32), cu)


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
        decode=decode,
    )


# --------------------------------------------------------------------------- one copy


_ALIGN_WORDS = 4  # fields start 16 bytes apart: int64 views are aligned, and Triton's
# pointer-alignment specialisation is the same for every field and every step


def packed_layout(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Word (int32) offset of each array in the packed buffer, and the words used.
    int64 arrays take two words per element."""
    offsets, end = [], 0
    for a in arrays:
        assert a.dtype in (np.int32, np.int64), a.dtype
        end = -(-end // _ALIGN_WORDS) * _ALIGN_WORDS
        offsets.append(end)
        end += a.size * (2 if a.dtype == np.int64 else 1)
    return offsets, end


class InputUploader:
    """Packs a step's integer arrays into one reused host buffer (pinned on CUDA,
    so the copy is asynchronous) and moves them to the device in one copy; the
    tensors handed back are views of the device buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        # The last copy out of the pinned buffer: it must be done before the buffer is rewritten.
        self._copied: torch.cuda.Event | None = None

    def upload(self, arrays: Sequence[np.ndarray], into: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`into`: a persistent int32 device buffer to copy into (a captured graph's)."""
        offsets, words = packed_layout(arrays)
        host = self._host_buffer(words)
        flat = host.numpy()
        for a, offset in zip(arrays, offsets):
            view = flat[offset : offset + a.size * (2 if a.dtype == np.int64 else 1)]
            (view.view(np.int64) if a.dtype == np.int64 else view)[:] = a.ravel()
        if into is None:
            into = torch.empty(words, dtype=torch.int32, device=self.device)
        assert into.numel() >= words, f"{words} words do not fit a buffer of {into.numel()}"
        into[:words].copy_(host[:words], non_blocking=self.pinned)
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
        tensors = []
        for a, offset in zip(arrays, offsets):
            if a.dtype == np.int64:
                t = into[offset : offset + 2 * a.size].view(torch.int64)
            else:
                t = into[offset : offset + a.size]
            tensors.append(t.view(a.shape))
        return tensors

    def _host_buffer(self, words: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()  # already done in practice: the last step read its samples
        if self._host.numel() < words:
            self._host = torch.empty(max(words, 2 * self._host.numel()), dtype=torch.int32, pin_memory=self.pinned)
        return self._host


def upload_batch(
    host: HostBatch,
    uploader: InputUploader,
    previous: LastSamples | None = None,
    into: torch.Tensor | None = None,
) -> ForwardBatch:
    """The device tensors of `host`, in one copy; then the decodes that name the
    previous step's samples take them on the device (they never went through the host)."""
    groups = [host.decode, host.fresh, host.prefill]
    arrays: list[np.ndarray] = [host.input_ids, host.positions, host.slot_mapping]
    for g in groups:
        if g is not None:
            arrays += [g.block_tables, g.context_lens, g.cu_query_lens]
    arrays += [host.sample_rows, host.ref_rows, host.ref_sources, host.copies]
    tensors = iter(uploader.upload(arrays, into))
    input_ids, positions, slot_mapping = next(tensors), next(tensors), next(tensors)
    device_groups = [
        None if g is None else AttentionGroup(*(next(tensors) for _ in range(3)), *_query_lens(g)) for g in groups
    ]
    sample_rows, ref_rows, ref_sources, copies = (next(tensors) for _ in range(4))
    if ref_rows.numel() and previous is not None:
        input_ids[ref_rows] = previous.token_ids[ref_sources]
    decode, fresh, prefill = device_groups
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        decode=decode,
        prefill=prefill,
        seqs=host.seqs,
        sample_rows=sample_rows,
        sample_seqs=host.sample_seqs,
        fresh=fresh,
        copy_src=copies[0] if copies.numel() else None,
        copy_dst=copies[1] if copies.numel() else None,
    )


def _query_lens(group: HostGroup) -> tuple[int, tuple[int, ...]]:
    lens = np.diff(group.cu_query_lens)
    return int(group.cu_query_lens[-1]), tuple(int(n) for n in lens)


def build_forward_batch(
    step: StepInput,
    device: torch.device,
    previous: LastSamples | None = None,
    uploader: InputUploader | None = None,
    split_fresh: bool = False,
) -> ForwardBatch:
    """plan_batch + upload_batch. `previous`: the samples of the step run last,
    for the decodes that take their input from it (checked by check_references)."""
    host = plan_batch(step, split_fresh)
    resolve_references(host, previous)
    return upload_batch(host, uploader or InputUploader(device), previous)


def check_references(step: StepInput, previous: LastSamples | None) -> None:
    """Every decode that names the previous step's sample must find it there."""
    for i, seq in enumerate(step.seqs):
        if not seq.token_from_previous_step:
            continue
        if previous is None or previous.step_id != step.previous_step_id or seq.seq_id not in previous.rows:
            raise InvalidStep(
                row_field("flags", i),
                f"SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP: seq_id {seq.seq_id} sampled nothing in step "
                f"{step.previous_step_id}",
            )
