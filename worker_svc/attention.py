"""Attention backends: write this step's K/V into the paged cache, then attend.

`torch` runs the reference ops in kernels/reference.py (the CPU path); `triton`
runs the Triton kernels (compiled on CUDA, or under TRITON_INTERPRET=1 in tests).
"""
from __future__ import annotations

import torch

from kernels import reference
from worker_svc.forward_batch import ForwardBatch
from worker_svc.kv_cache import PagedKVCache

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


class PagedAttention:
    """Callable the decoder invokes per layer for one step's batch."""

    def __init__(self, ops, cache: PagedKVCache, batch: ForwardBatch, scale: float):
        self.ops = ops
        self.cache = cache
        self.batch = batch
        self.scale = scale

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        k_cache, v_cache = self.cache.layer(layer)
        scales = self.cache.layer_scales(layer)  # FP8/INT8: quantize on write, dequantize on read
        batch = self.batch
        self.ops.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, **scales)
        parts = []
        split = batch.decode.num_tokens if batch.decode else 0
        if batch.decode:
            group = batch.decode
            parts.append(self.ops.paged_decode_attention(
                q[:split], k_cache, v_cache, group.block_tables, group.context_lens, self.scale, window, **scales))
        if batch.prefill:
            group = batch.prefill
            parts.append(self.ops.paged_prefill_attention(
                q[split:], k_cache, v_cache, group.block_tables, group.cu_query_lens, group.context_lens,
                self.scale, window, **scales))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
