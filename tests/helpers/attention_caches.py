"""Paged K/V caches for the attention kernels' tests against the reference ops."""

from __future__ import annotations

import torch

from kernels import quant, reference


def make_cache(
    num_blocks: int, kv_heads: int, head_dim: int, cache_dtype: torch.dtype, block_size: int = 16, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, dict[str, quant.KVScales]]:
    """A filled cache: K/V written through reference.write_kv, so a quantized cache
    holds real 8-bit values with their per-token scales (and zero points)."""
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    kv_scales = quant.KVScales.zeros(shape, cache_dtype, k_cache.device)
    scales = {} if kv_scales is None else {"scales": kv_scales}
    tokens = num_blocks * block_size
    key = torch.randn(tokens, kv_heads, head_dim, generator=g) * 2 + 0.5
    value = torch.randn(tokens, kv_heads, head_dim, generator=g)
    reference.write_kv(key, value, k_cache, v_cache, torch.arange(tokens), **scales)
    return k_cache, v_cache, scales
