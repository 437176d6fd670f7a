"""Prefill routing (--prefill-attention): a chunk with no cached context (it
starts at position 0) attends only to its own K/V, which the layer has in hand,
so it can skip the paged read and go to one flash varlen call for all such chunks
(torch.nn.attention.varlen on CUDA; torch's scaled_dot_product_attention per
chunk elsewhere). `prefill_route` says when; `sdpa_takes` says for which layers
and caches the result is the paged op's."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

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


def sdpa_takes(
    cache_dtype: torch.dtype, query_dtype: torch.dtype, window: int, longest_chunk: int, softcap: float = 0.0
) -> bool:
    """Whether SDPA over fresh chunks' own K/V equals the paged op, which reads them
    back from the cache: only when the cache stores them as they are (same dtype;
    a quantized or narrower cache changes them), the layer's sliding window hides
    nothing inside the chunk (none, or at least as long as the chunk) and its scores
    are not soft-capped (neither SDPA nor flash varlen caps them)."""
    return cache_dtype == query_dtype and (window == 0 or longest_chunk <= window) and not softcap


# A varlen call: (query, key, value, cu_seq_lens, max_len, scale) -> out, causal.
Varlen = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256


@functools.cache
def varlen_attention() -> Varlen | None:
    """torch's flash varlen attention (torch.nn.attention.varlen, torch >= 2.10) as
    one causal call over chunks laid end to end; None where this torch lacks it.
    Its causal switch changed between releases (is_causal in 2.10, window_size
    after), and a GQA switch came later still (the flash kernel takes fewer K/V
    heads than query heads either way): read from its signature."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    attn: Any = varlen.varlen_attn  # its keywords differ between torch releases
    params = inspect.signature(attn).parameters
    if "scale" not in params:
        return None
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    gqa_flag = "enable_gqa" in params

    def call(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, longest: int, scale: float
    ) -> torch.Tensor:
        gqa = {"enable_gqa": True} if gqa_flag and query.shape[1] != key.shape[1] else {}
        out = attn(query, key, value, cu, cu, longest, longest, scale=scale, **causal, **gqa)
        assert isinstance(out, torch.Tensor)
        return out

    return call


def varlen_takes(query: torch.Tensor) -> bool:
    """Whether flash varlen computes these chunks: on CUDA, fp16/bf16, head_dim a
    multiple of 8 up to 256 (flash attention's limits), in a torch that has it."""
    head_dim = query.shape[-1]
    return (
        query.is_cuda
        and query.dtype in _FLASH_DTYPES
        and head_dim % 8 == 0
        and head_dim <= _FLASH_MAX_HEAD_DIM
        and varlen_attention() is not None
    )


def fresh_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_query_lens: torch.Tensor,
    query_lens: tuple[int, ...],
    scale: float,
) -> torch.Tensor:
    """Causal attention of chunks that start at position 0 over their own K/V:
    query [T, q_heads, d], key/value [T, kv_heads, d], chunks end to end
    (cu_query_lens [S + 1] int32 on the device, query_lens their lengths on the
    host). One flash varlen call for all chunks where it runs (varlen_takes: a
    GPU, half precision); elsewhere one SDPA call per chunk, on strided views."""
    if varlen_takes(query):
        varlen = varlen_attention()
        assert varlen is not None
        return varlen(query, key, value, cu_query_lens, max(query_lens), scale)
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
