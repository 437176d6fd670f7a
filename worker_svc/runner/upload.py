"""A HostBatch to the device in one copy: every integer array of it packed into
one reused host buffer (pinned on CUDA, so the copy is asynchronous), copied in
one call, and handed back as views of the device buffer (a ForwardBatch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.attention.metadata import AttentionGroup, AttentionMetadata
from worker_svc.runner.batch import ForwardBatch, HostBatch, HostGroup
from worker_svc.runner.last_samples import LastSamples

_ALIGN_WORDS = 4  # fields start 16 bytes apart: int64 views are aligned, and Triton's
# pointer-alignment specialisation is the same for every field and every step


def packed_layout(arrays: Sequence[npt.NDArray[np.int32] | npt.NDArray[np.int64]]) -> tuple[list[int], int]:
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
    """Packs a step's integer arrays into one reused host buffer and moves them to
    the device in one copy; the tensors handed back are views of the device buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        # The last copy out of the pinned buffer: it must be done before the buffer is rewritten.
        self._copied: torch.cuda.Event | None = None

    def upload(
        self, arrays: Sequence[npt.NDArray[np.int32] | npt.NDArray[np.int64]], into: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
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
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
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
    decode_tables: torch.Tensor | None = None,
    extra: Sequence[npt.NDArray[np.int32] | npt.NDArray[np.int64]] = (),
) -> ForwardBatch:
    """The device tensors of `host`, in one copy; then the decodes that name the
    previous step's samples take them on the device (they never went through the
    host). `decode_tables`: the decode group's block tables already on the device
    (a captured graph's persistent table), not sent; `extra`: more arrays for the
    same copy (the sampler's logprob indices, a table's changed entries), handed
    back as ForwardBatch.extra."""
    groups = [host.decode, host.fresh, host.prefill]
    arrays: list[npt.NDArray[np.int32] | npt.NDArray[np.int64]] = [
        host.input_ids,
        host.positions,
        host.slot_mapping,
        host.lora_slots,
    ]
    for kind, g in zip(("decode", "fresh", "prefill"), groups):
        if g is not None:
            sent_tables = [] if kind == "decode" and decode_tables is not None else [g.block_tables]
            arrays += [*sent_tables, g.context_lens, g.cu_query_lens]
    arrays += [host.sample_rows, host.ref_rows, host.ref_sources, host.copies, *extra]
    tensors = iter(uploader.upload(arrays, into))
    input_ids, positions, slot_mapping, lora_slots = (next(tensors) for _ in range(4))

    def group(kind: str, g: HostGroup | None) -> AttentionGroup | None:
        if g is None:
            return None
        tables = decode_tables if kind == "decode" and decode_tables is not None else next(tensors)
        return AttentionGroup(tables, next(tensors), next(tensors), *_query_lens(g))

    decode, fresh, prefill = (group(kind, g) for kind, g in zip(("decode", "fresh", "prefill"), groups))
    sample_rows, ref_rows, ref_sources, copies = (next(tensors) for _ in range(4))
    extra_tensors = tuple(tensors)
    if ref_rows.numel() and previous is not None:
        input_ids[ref_rows] = previous.token_ids[ref_sources]
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        lora_slots=lora_slots,
        attention=AttentionMetadata(slot_mapping, decode, fresh, prefill),
        sample_rows=sample_rows,
        copy_src=copies[0] if copies.numel() else None,
        copy_dst=copies[1] if copies.numel() else None,
        extra=extra_tensors,
    )


def _query_lens(group: HostGroup) -> tuple[int, tuple[int, ...]]:
    lens = np.diff(group.cu_query_lens)
    return int(group.cu_query_lens[-1]), tuple(int(n) for n in lens)
