"""A paged cache's blocks as bytes and back. The bytes of N blocks are each tensor
of the pool in turn (K, V, then a quantized cache's scales and zero points), each as
its [layers, N, kv_heads, block_size(, head_dim)] slab in memory order: the cache's
own layout with the block axis narrowed, so a read is one gather per tensor and a
write one copy per run of consecutive blocks, with no transpose. Two workers with
the same model, block size and KV dtype lay blocks out alike, whatever their device.

Where the time goes (bench/results/disaggregation.md has the split): a fresh
buffer of megabytes costs its page faults on every call, so a stream of reads
gathers into one buffer it keeps (buffer()), and hands out a view of it, not a
copy; a write takes the received bytes as they are (no copy into a writable
buffer) and copies whole block rows, never index_copy_ over single bytes (an
element-wise loop, 40x slower than the rows' memcpy)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

# torch.frombuffer warns that a bytes object is read-only; write() only reads it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)


class BlockCodec:
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """tensors: the pool's tensors, each [layers, blocks, ...] (KVCache.tensors)."""
        # As bytes: copies are then one dtype-blind op for every cache dtype (fp8 included).
        self._tensors = tuple(t.view(torch.uint8) for t in tensors)
        self._device = self._tensors[0].device
        self.num_blocks = self._tensors[0].shape[1]
        self._part_bytes = [t[:, 0].numel() for t in self._tensors]
        self.block_bytes = sum(self._part_bytes)

    def buffer(self, blocks: int) -> torch.Tensor:
        """A gather buffer for reads of up to `blocks` blocks, to pass to read() again and again."""
        return torch.empty(blocks * self.block_bytes, dtype=torch.uint8, device="cpu")

    def read(self, ids: Sequence[int], buffer: torch.Tensor | None = None) -> memoryview:
        """The blocks' bytes, each tensor's slab of them in turn, gathered into `buffer`
        (from buffer(); None: a fresh one): a view of it, valid until it is read into again."""
        size = len(ids) * self.block_bytes
        if buffer is not None and buffer.numel() < size:
            raise ValueError(f"a buffer of {buffer.numel()} bytes for {len(ids)} blocks of {self.block_bytes}")
        out = self.buffer(len(ids)) if buffer is None else buffer[:size]
        # On an accelerator the gather runs there, then one copy to the host.
        gathered = out if self._device.type == "cpu" else torch.empty(size, dtype=torch.uint8, device=self._device)
        index = torch.as_tensor(list(ids), dtype=torch.long, device=self._device)
        for tensor, slab in zip(self._tensors, self._slabs(gathered, len(ids))):
            torch.index_select(tensor, 1, index, out=slab)
        if gathered is not out:
            out.copy_(gathered)
        return out.numpy().data

    def write(self, ids: Sequence[int], data: bytes | memoryview) -> None:
        """Store len(ids) blocks' bytes (as read() gives them) into the blocks `ids`."""
        if len(data) != len(ids) * self.block_bytes:
            raise ValueError(f"{len(data)} bytes for {len(ids)} blocks of {self.block_bytes}")
        flat = torch.frombuffer(data, dtype=torch.uint8).to(self._device)
        runs = _runs(list(ids))
        for tensor, slab in zip(self._tensors, self._slabs(flat, len(ids))):
            for first, start, count in runs:
                tensor[:, start : start + count].copy_(slab[:, first : first + count])

    def _slabs(self, flat: torch.Tensor, count: int) -> list[torch.Tensor]:
        """Each tensor's [layers, count, ...] slab of a flat buffer, in turn."""
        slabs, offset = [], 0
        for tensor, size in zip(self._tensors, self._part_bytes):
            slabs.append(flat[offset : offset + count * size].view(tensor.shape[0], count, *tensor.shape[2:]))
            offset += count * size
        return slabs


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index into ids, first id, count) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((i, block, 1))
    return runs
