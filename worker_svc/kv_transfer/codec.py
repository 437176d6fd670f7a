"""A paged cache's blocks as bytes and back. A block's bytes are its tensors' slices
in the pool's order (K, V, then a quantized cache's scales and zero points), each
[layers, kv_heads, block_size(, head_dim)] in memory order: two workers with the
same model, block size and KV dtype lay a block out alike, whatever their device."""

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
        """The blocks' bytes, block after block."""
        index = torch.as_tensor(list(ids), dtype=torch.long, device=self._device)
        parts = [
            t.index_select(1, index).transpose(0, 1).contiguous().cpu().reshape(len(ids), -1)
            for t in self._tensors
        ]
        return torch.cat(parts, dim=1).numpy().tobytes()

    def write(self, ids: Sequence[int], data: bytes) -> None:
        """Store len(ids) blocks' bytes (as read() gives them) into the blocks `ids`."""
        if len(data) != len(ids) * self.block_bytes:
            raise ValueError(f"{len(data)} bytes for {len(ids)} blocks of {self.block_bytes}")
        rows = torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(len(ids), self.block_bytes)
        index = torch.as_tensor(list(ids), dtype=torch.long, device=self._device)
        offset = 0
        for tensor, size in zip(self._tensors, self._part_bytes):
            part = rows[:, offset : offset + size]
            blocks = part.reshape(len(ids), tensor.shape[0], *tensor.shape[2:]).transpose(0, 1)
            tensor.index_copy_(1, index, blocks.to(self._device))
            offset += size
