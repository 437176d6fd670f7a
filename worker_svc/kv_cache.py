"""The paged K/V block tensors a worker owns: [layers, blocks, kv_heads, block_size, head_dim].

A quantized cache (FP8 e4m3 or INT8, kernels/quant.py) also owns its per-token,
per-KV-head scales (fp32) and, for INT8, zero points (int8), shaped
[layers, blocks, kv_heads, block_size]: written with their token by write_kv,
read by the attention ops, copied with their block by copy_blocks.
"""
from __future__ import annotations

import torch

from kernels import quant, reference


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k_scale = self.v_scale = self.k_zero = self.v_zero = None
        if quant.is_quantized(dtype):
            self.k_scale = torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=quant.SCALE_DTYPE, device=device)
            if quant.has_zero_point(dtype):
                self.k_zero = torch.zeros(shape[:-1], dtype=quant.ZERO_DTYPE, device=device)
                self.v_zero = torch.zeros(shape[:-1], dtype=quant.ZERO_DTYPE, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @staticmethod
    def scale_bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block's scales and zero points, all layers, K and V (0 unquantized)."""
        return 2 * num_layers * num_kv_heads * block_size * quant.scale_bytes_per_token_head(dtype)

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block, all layers, K and V, scales included: what a block costs
        when sizing the pool from a memory budget."""
        element = torch.empty((), dtype=dtype).element_size()
        values = 2 * num_layers * num_kv_heads * block_size * head_dim * element
        return values + PagedKVCache.scale_bytes_per_block(num_layers, num_kv_heads, block_size, dtype)

    @property
    def block_bytes(self) -> int:
        num_layers, _, num_kv_heads, block_size, head_dim = self.k.shape
        return self.bytes_per_block(num_layers, num_kv_heads, block_size, head_dim, self.dtype)

    @property
    def scale_block_bytes(self) -> int:
        num_layers, _, num_kv_heads, block_size, _ = self.k.shape
        return self.scale_bytes_per_block(num_layers, num_kv_heads, block_size, self.dtype)

    @property
    def total_bytes(self) -> int:
        """What the pool's tensors take, scales included (== num_blocks * block_bytes)."""
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, *self.scale_tensors().values()))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def layer_scales(self, i: int) -> dict[str, torch.Tensor]:
        """Keyword arguments of the ops for layer i: its scales (and zero points);
        empty for an unquantized cache, so the ops' unquantized call is unchanged."""
        return {name: t[i] for name, t in self.scale_tensors().items()}

    def scale_tensors(self) -> dict[str, torch.Tensor]:
        """The all-layer scale / zero-point tensors by op keyword (empty unquantized)."""
        tensors = dict(k_scale=self.k_scale, v_scale=self.v_scale, k_zero=self.k_zero, v_zero=self.v_zero)
        return {name: t for name, t in tensors.items() if t is not None}

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if src:
            index = lambda ids: torch.tensor(ids, dtype=torch.long, device=self.k.device)  # noqa: E731
            reference.copy_blocks(self.k, self.v, index(src), index(dst), **self.scale_tensors())
