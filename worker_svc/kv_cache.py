"""The paged K/V block tensors a worker owns: [layers, blocks, kv_heads, block_size, head_dim]."""
from __future__ import annotations

import torch

from kernels import reference


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * block_size * head_dim * element

    @property
    def block_bytes(self) -> int:
        num_layers, _, num_kv_heads, block_size, head_dim = self.k.shape
        return self.bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, self.dtype)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if src:
            index = lambda ids: torch.tensor(ids, dtype=torch.long, device=self.k.device)  # noqa: E731
            reference.copy_blocks(self.k, self.v, index(src), index(dst))
