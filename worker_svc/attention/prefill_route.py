"""Prefill routing (--prefill-attention): a chunk with no cached context (it
starts at position 0) attends only to its own K/V, which the layer has in hand,
so it can skip the paged read and go to torch's scaled_dot_product_attention
(flash attention on CUDA). `prefill_route` says when; `sdpa_takes` says for which
layers and caches the result is the paged op's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_ATTENTION = ("auto", "paged", "sdpa")


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
