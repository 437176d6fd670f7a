"""A decoder layer's element-wise work as two kernels (issue 27, fault 9), with
kernels/reference.py's semantics: add_rms_norm (the residual add and the next RMSNorm:
one program per row instead of three kernels) and rope_write_kv (RoPE on q and k and
the K/V write: one program per token instead of ~12 kernels per layer). They round
once from fp32, where the reference rounds after every op in a narrow dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.quant import KVScales, checked_scales
from kernels.triton.kv_quant import to_cache
from kernels.triton.kv_write import write_kv


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    normed_ptr,
    summed_ptr,
    stride_x,
    stride_r,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK_H)
    mask = col < hidden
    x = tl.load(x_ptr + row * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = tl.load(res_ptr + row * stride_r + col, mask=mask, other=0.0).to(tl.float32) + x
    summed = x.to(summed_ptr.dtype.element_ty)  # the residual stream lives in x's dtype
    tl.store(summed_ptr + row * hidden + col, summed, mask=mask)
    s = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
    w = tl.load(w_ptr + col, mask=mask, other=0.0)
    tl.store(normed_ptr + row * hidden + col, (s * inv * w).to(normed_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """reference.add_rms_norm, one program per row."""
    assert x.dim() == 2 and x.stride(1) == 1, x.stride()
    rows, hidden = x.shape
    normed, summed = (torch.empty(rows, hidden, dtype=x.dtype, device=x.device) for _ in range(2))
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            x if residual is None else residual,
            weight.float().contiguous(),
            normed,
            summed,
            x.stride(0),
            0 if residual is None else residual.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_H=triton.next_power_of_2(hidden),
        )
    return normed, summed


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, heads, c1, c2, s1, s2, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """The rotate-half RoPE of one token's heads [heads, 2 * HALF] in fp32: halves
    (x1, x2) -> (x1 c1 - x2 s1, x2 c2 + x1 s2)."""
    head = tl.arange(0, BLOCK_HEADS)[:, None]
    dim = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (head < heads) & (dim < HALF)
    x1 = tl.load(x_ptr + head * stride_h + dim, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + head * stride_h + HALF + dim, mask=mask, other=0.0).to(tl.float32)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, head, dim, mask


@triton.jit
def _rope_write_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ch,
    stride_cs,
    q_heads,
    kv_heads,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WRITE: tl.constexpr,  # False: a quantized cache, written by write_kv after
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < HALF
    row = tok * 2 * HALF
    c1 = tl.load(cos_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    a, b, head, dim, mask = _rotate_heads(
        q_ptr + tok * stride_qt, stride_qh, q_heads, c1, c2, s1, s2, HALF, BLOCK_QH, BLOCK_HALF
    )
    out = q_out_ptr + tok * q_heads * 2 * HALF + head * 2 * HALF + dim
    tl.store(out, a.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, b.to(q_out_ptr.dtype.element_ty), mask=mask)
    a, b, head, dim, mask = _rotate_heads(
        k_ptr + tok * stride_kt, stride_kh, kv_heads, c1, c2, s1, s2, HALF, BLOCK_KH, BLOCK_HALF
    )
    a, b = a.to(k_out_ptr.dtype.element_ty), b.to(k_out_ptr.dtype.element_ty)  # rounded as the query's dtype
    out = k_out_ptr + tok * kv_heads * 2 * HALF + head * 2 * HALF + dim
    tl.store(out, a, mask=mask)
    tl.store(out + HALF, b, mask=mask)
    if WRITE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:  # < 0: a padding row, nothing written
            dst = slot // BLOCK_SIZE * stride_cb + slot % BLOCK_SIZE * stride_cs + head * stride_ch + dim
            tl.store(k_cache_ptr + dst, to_cache(a.to(tl.float32), k_cache_ptr), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, to_cache(b.to(tl.float32), k_cache_ptr), mask=mask)
            v_row = v_ptr + tok * stride_vt + head * stride_vh + dim
            v1 = tl.load(v_row, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_row + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(v_cache_ptr + dst, to_cache(v1, v_cache_ptr), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, to_cache(v2, v_cache_ptr), mask=mask)


def rope_write_kv(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    scales: KVScales | None = None,
) -> tuple[Tensor, Tensor]:
    """reference.rope_write_kv: one program per token rotates its q and k heads and,
    into an unquantized cache, writes k and v; a quantized cache is written after by
    write_kv's quantizing kernel (two launches)."""
    num_tokens, q_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    assert query.stride(2) == key.stride(2) == value.stride(2) == 1 and head_dim % 2 == 0
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride() and k_cache.stride(3) == 1
    scales = checked_scales(k_cache, v_cache, scales)
    q_out = torch.empty(num_tokens, q_heads, head_dim, dtype=query.dtype, device=query.device)
    k_out = torch.empty(num_tokens, kv_heads, head_dim, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_write_kv_kernel[(num_tokens,)](
        query,
        key,
        value,
        cos.contiguous(),
        sin.contiguous(),
        q_out,
        k_out,
        k_cache,
        v_cache,
        slot_mapping,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        q_heads,
        kv_heads,
        HALF=half,
        BLOCK_SIZE=k_cache.shape[2],
        WRITE=scales is None,
        BLOCK_QH=triton.next_power_of_2(q_heads),
        BLOCK_KH=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
    )
    if scales is not None:
        write_kv(k_out, value, k_cache, v_cache, slot_mapping, scales=scales)
    return q_out, k_out
