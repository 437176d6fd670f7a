"""Attention backends: write this step's K/V into the cache, then attend.

`torch` runs the reference ops in kernels/reference.py (the CPU path); `triton`
runs the Triton kernels (compiled on CUDA, or under TRITON_INTERPRET=1 in tests).
The cache (paged or contiguous, worker_svc/kv_cache.py) picks which ops of the
backend read its layout.

Prefill routing (--prefill-attention): a chunk with no cached context (it starts
at position 0) attends only to its own K/V, which the layer has in hand, so it
can skip the paged read and go to torch's scaled_dot_product_attention (flash
attention on CUDA). `prefill_route` says when; `sdpa_takes` says for which
layers and caches the result is the paged op's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import reference
from worker_svc.forward_batch import AttentionGroup, ForwardBatch
from worker_svc.kv_cache import KVCachePool

BACKENDS = ("auto", "torch", "triton")
PREFILL_ATTENTION = ("auto", "paged", "sdpa")


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def load_ops(backend: str):
    if backend == "torch":
        return reference
    from kernels import triton_ops  # imported lazily: triton is heavy and optional on CPU

    return triton_ops


def prefill_route(choice: str, device: torch.device, backend: str) -> str:
    """'sdpa' or 'paged' for the chunks that start at position 0.

    auto: sdpa on CUDA with the Triton backend, whose paged prefill kernel measured
    0.49x torch SDPA flash at head_dim 128 and 0.59x at head_dim 64 on an H100
    (issue 17; not re-measured after this routing, see docs/design.md); paged
    elsewhere: on CPU the torch backend's prefill already is one SDPA call, and
    which is faster there is unmeasured."""
    if choice == "auto":
        return "sdpa" if device.type == "cuda" and backend == "triton" else "paged"
    if choice not in ("paged", "sdpa"):
        raise ValueError(f"prefill attention must be one of {PREFILL_ATTENTION}, got {choice!r}")
    return choice


def sdpa_takes(cache_dtype: torch.dtype, query_dtype: torch.dtype, window: int, longest_chunk: int) -> bool:
    """Whether SDPA over fresh chunks' own K/V equals the paged op, which reads them
    back from the cache: only when the cache stores them as they are (same dtype;
    a quantized or narrower cache changes them) and the layer's sliding window
    hides nothing inside the chunk (none, or at least as long as the chunk)."""
    return cache_dtype == query_dtype and (window == 0 or longest_chunk <= window)


def fresh_prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_lens: tuple[int, ...], scale: float
) -> torch.Tensor:
    """Causal attention of chunks that start at position 0 over their own K/V:
    query [T, q_heads, d], key/value [T, kv_heads, d], chunks end to end. One SDPA
    call per chunk, on strided views (no padding, no copies in)."""
    out = torch.empty_like(query)
    gqa = query.shape[1] != key.shape[1]
    start = 0
    for n in query_lens:
        rows = slice(start, start + n)
        q, k, v = (t[rows].transpose(0, 1)[None] for t in (query, key, value))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[rows] = attended[0].transpose(0, 1)
        start += n
    return out


class CacheAttention:
    """Callable the decoder invokes per layer for one step's batch."""

    def __init__(self, ops, cache: KVCachePool, batch: ForwardBatch, scale: float, route: str = "paged"):
        self.ops = ops
        self.cache = cache
        self.batch = batch
        self.scale = scale
        self.route = route

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
        # FP8/INT8 caches quantize on write and dequantize on read.
        self.cache.write(self.ops, layer, k, v, self.batch.slot_mapping)
        b = self.batch
        parts, start = [], 0
        for kind, group in (("decode", b.decode), ("fresh", b.fresh), ("prefill", b.prefill)):
            if group is not None:
                rows = slice(start, start + group.num_tokens)
                start += group.num_tokens
                parts.append(self._attend(kind, layer, q[rows], k[rows], v[rows], group, window))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _attend(self, kind: str, layer: int, q, k, v, group: AttentionGroup, window: int) -> torch.Tensor:
        if kind == "decode":
            return self.cache.decode(self.ops, layer, q, group, self.scale, window)
        longest = max(group.query_lens)
        if kind == "fresh" and self.route == "sdpa" and sdpa_takes(self.cache.dtype, q.dtype, window, longest):
            return fresh_prefill_attention(q, k, v, group.query_lens, self.scale)
        return self.cache.prefill(self.ops, layer, q, group, self.scale, window)
