"""A paged cache's blocks as bytes and back. The bytes of N blocks are each tensor
of the pool in turn (K, V, then a quantized cache's scales and zero points), each as
its [layers, N, kv_heads, block_size(, head_dim)] slab in memory order: the cache's
own layout with the block axis narrowed, so a read is one gather per tensor and a
write one scatter, with no transpose. Two workers with the same model, block size
and KV dtype lay blocks out alike, whatever their device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockCodec:
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """tensors: the pool's tensors, each [layers, blocks, ...] (KVCache.tensors)."""
        # As bytes: copies are then one dtype-blind op for every cache dtype (fp8 included).
        self._tensors = tuple(t.view(torch.uint8) for t in tensors)
        self._device = self._tensors[0].device
        self.num_blocks = self._tensors[0].shape[1]
        self._part_bytes = [t[:, 0].numel() for t in self._tensors]
        self.block_bytes = sum(self._part_bytes)

    def read(self, ids: Sequence[int]) -> bytes:
        """The blocks' bytes: each tensor's slab of them in turn."""
        index = torch.as_tensor(list(ids), dtype=torch.long, device=self._device)
        out = torch.empty(len(ids) * self.block_bytes, dtype=torch.uint8, device=self._device)
        offset = 0
        for tensor, size in zip(self._tensors, self._part_bytes):
            slab = out[offset : offset + len(ids) * size].view(tensor.shape[0], len(ids), *tensor.shape[2:])
            torch.index_select(tensor, 1, index, out=slab)
            offset += len(ids) * size
        return out.cpu().numpy().tobytes()

    def write(self, ids: Sequence[int], data: bytes) -> None:
        """Store len(ids) blocks' bytes (as read() gives them) into the blocks `ids`."""
        if len(data) != len(ids) * self.block_bytes:
            raise ValueError(f"{len(data)} bytes for {len(ids)} blocks of {self.block_bytes}")
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self._device)
        index = torch.as_tensor(list(ids), dtype=torch.long, device=self._device)
        offset = 0
        for tensor, size in zip(self._tensors, self._part_bytes):
            slab = flat[offset : offset + len(ids) * size].view(tensor.shape[0], len(ids), *tensor.shape[2:])
            tensor.index_copy_(1, index, slab)
            offset += len(ids) * size
