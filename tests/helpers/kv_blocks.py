"""A small paged KV cache filled with random bits, for the block-transfer tests."""

from __future__ import annotations

import torch

from worker_svc.attention.kv_cache import PagedKVCache

LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM = 3, 12, 2, 4, 8


def filled_cache(dtype: torch.dtype, seed: int) -> PagedKVCache:
    cache = PagedKVCache(LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM, dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    for tensor in cache.tensors:
        raw = torch.randint(0, 255, tensor.shape + (tensor.element_size(),), generator=gen, dtype=torch.uint8)
        tensor.view(torch.uint8).copy_(raw.reshape(tensor.view(torch.uint8).shape))
    return cache
