"""CUDA graphs for decode-only steps.

A decode step of a small model is hundreds of tiny kernels; launched one by one
from Python the GPU waits on the CPU. A captured graph replays them all in one
launch. Graphs need fixed shapes and fixed addresses, so:

* a ladder of batch sizes (1, 2, 4, 8, then every 8 up to --max-num-seqs) is
  captured at start-up, and a decode batch is padded up to the next rung
  (batch.pad_decode says what a padding row does: writes nothing, reads one
  finite position);
* every input the forward reads (ids, positions, slots, context lengths) lives
  in one persistent device buffer, which each step fills with its one
  host->device copy (upload.upload_batch into that buffer) before replaying;
  the block tables live in a persistent table as wide as the longest sequence
  allowed (block_table.DeviceBlockTable), of which a step sends only the
  entries that changed, in that same copy;
* prefill and mixed steps, bigger batches, and steps whose tables or block
  copies do not fit stay eager.

The capture goes through a `GraphBackend`: `CudaGraphBackend` records real
graphs; the CPU tests' EagerReplay (tests/unit/test_cuda_graphs.py) runs the
forward again at each replay, so the same buffer filling, padding and
un-padding run there and are tested against eager.
warm_up.py compares one captured size with the eager forward at start-up; the
runner drops its graphs (one warning) if they differ.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.runner.batch import ForwardBatch, HostBatch, HostGroup, pad_decode
from worker_svc.runner.block_table import DeviceBlockTable
from worker_svc.runner.last_samples import LastSamples
from worker_svc.runner.upload import InputUploader, packed_layout, upload_batch

Replay = Callable[[], torch.Tensor]


def batch_ladder(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then steps of 8, up to max_num_seqs (always included)."""
    assert max_num_seqs >= 1, max_num_seqs
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def ladder_rung(ladder: list[int], num_seqs: int) -> int | None:
    """The smallest captured size holding num_seqs, None past the top."""
    i = bisect.bisect_left(ladder, num_seqs)
    return ladder[i] if i < len(ladder) else None


class GraphBackend(Protocol):
    def capture(self, forward: Replay) -> Replay:
        """Record `forward` (over persistent buffers); the replay returns its output."""


class CudaGraphBackend:
    """torch.cuda.CUDAGraph, all graphs in one memory pool: captured largest first,
    the smaller ones reuse the largest one's activation memory."""

    def __init__(self, device: torch.device):
        assert device.type == "cuda", f"CUDA graphs need a CUDA device, got {device}"
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Replay) -> Replay:
        forward()  # compiles every Triton specialisation this size needs, outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """The captured decode forwards, one per ladder size, and their input buffer."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], torch.Tensor],
        backend: GraphBackend,
        device: torch.device,
        max_num_seqs: int,
        table_width: int,
    ):
        self.forward = forward
        self.backend = backend
        self.ladder = batch_ladder(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.table_width = table_width  # blocks per table: the longest sequence the worker serves
        self.uploader = InputUploader(device)
        self.tables = DeviceBlockTable(max_num_seqs, table_width, device)
        # The top rung's inputs plus the rest of a step's upload (samples, references,
        # copies, the sampler's logprob indices, the table's changed entries).
        self.buffer = torch.zeros(_buffer_words(max_num_seqs, table_width), dtype=torch.int32, device=device)
        self.replays: dict[int, Replay] = {}

    def capture(self) -> None:
        for size in reversed(self.ladder):  # largest first: see CudaGraphBackend
            batch = self.upload(padding_batch(size, 1))
            self.replays[size] = self.backend.capture(functools.partial(self.forward, batch))

    def covers(self, host: HostBatch) -> bool:
        """A decode-only batch within the ladder whose tables and copies fit the buffer."""
        return (
            host.decode_only
            and host.decode is not None
            and host.num_tokens <= self.max_num_seqs
            and host.decode.block_tables.shape[1] <= self.table_width
            and host.copies.shape[1] <= self.max_num_seqs
        )

    def upload(
        self,
        host: HostBatch,
        previous: LastSamples | None = None,
        extra: Sequence[npt.NDArray[np.int64]] = (),
    ) -> ForwardBatch:
        """The batch padded to its rung, copied into the captured graph's inputs:
        its tables' changed entries only (DeviceBlockTable), in the same copy.
        `extra` (at most one entry per row each: the sampler's logprob indices)
        rides along as upload_batch's; ForwardBatch.extra holds them."""
        size = ladder_rung(self.ladder, host.num_tokens)
        assert size is not None and self.covers(host), "not a batch the graphs cover"
        assert len(extra) <= _EXTRA_ARRAYS and all(a.size <= self.max_num_seqs for a in extra)
        assert host.decode is not None
        padded = pad_decode(host, size, host.decode.block_tables.shape[1])  # as wide as this step's tables
        assert padded.decode is not None
        flat, values = self.tables.changes(padded.decode.block_tables)
        batch = upload_batch(
            padded,
            self.uploader,
            previous,
            into=self.buffer,
            decode_tables=self.tables.tensor[:size],
            extra=[flat, values, *extra],
        )
        flat_on_device, values_on_device, *rest = batch.extra
        self.tables.apply(flat, values, flat_on_device, values_on_device)
        return dataclasses.replace(batch, extra=tuple(rest))

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of the padded batch [size, hidden]; the real rows come first."""
        return self.replays[batch.input_ids.shape[0]]()


def padding_batch(size: int, table_width: int) -> HostBatch:
    """`size` padding rows and no real ones: what each graph is captured over."""
    empty = np.zeros(0, dtype=np.int64)
    host = HostBatch(
        input_ids=empty,
        positions=empty,
        slot_mapping=empty,
        lora_slots=empty,
        decode=HostGroup(np.zeros((0, 1), np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32)),
        fresh=None,
        prefill=None,
        sample_rows=empty,
        ref_rows=empty,
        ref_sources=empty,
        copies=np.zeros((2, 0), dtype=np.int64),
        order=empty,
        sample_order=empty,
    )
    return pad_decode(host, size, table_width)


# Arrays a covered step may add to its upload (the sampler's logprob indices), each one entry per row at most.
_EXTRA_ARRAYS = 4


def _buffer_words(max_num_seqs: int, table_width: int) -> int:
    """Words of the largest upload a covered step makes: the top rung's inputs, a
    sample and a reference per row, up to max_num_seqs block copies, every table
    entry changed (the first step, or a reshuffled batch; most steps send few),
    and the extra arrays."""
    rows = np.zeros(max_num_seqs, dtype=np.int64)
    entries = max_num_seqs * table_width
    shapes: list[npt.NDArray[np.int32] | npt.NDArray[np.int64]] = [
        rows,
        rows,
        rows,
        rows,
        np.zeros(max_num_seqs, np.int32),
        np.zeros(max_num_seqs + 1, np.int32),
        rows,
        rows,
        rows,
        np.zeros((2, max_num_seqs), np.int64),
        np.zeros(entries, np.int64),
        np.zeros(entries, np.int32),
        *[rows] * _EXTRA_ARRAYS,
    ]
    return packed_layout(shapes)[1]
