"""Attention backends: write this step's K/V into the cache, then attend.

`torch` runs the reference ops in kernels/reference.py (the CPU path); `triton`
runs the Triton kernels (compiled on CUDA, or under TRITON_INTERPRET=1 in tests).
The cache (paged or contiguous, worker_svc/kv_cache.py) picks which ops of the
backend read its layout.
"""

from __future__ import annotations

import torch

from kernels import reference
from worker_svc.forward_batch import ForwardBatch
from worker_svc.kv_cache import KVCachePool

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def load_ops(backend: str):
    if backend == "torch":
        return reference
    from kernels import triton_ops  # imported lazily: triton is heavy and optional on CPU

    return triton_ops


class CacheAttention:
    """Callable the decoder invokes per layer for one step's batch."""

    def __init__(self, ops, cache: KVCachePool, batch: ForwardBatch, scale: float):
        self.ops = ops
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        # FP8/INT8 caches quantize on write and dequantize on read.
        self.cache.write(self.ops, layer, k, v, self.batch.slot_mapping)
        return self.cache.attend(self.ops, layer, q, self.batch, self.scale, window)
