"""write_kv (kernels/reference.py's, same signature): scatter this step's K/V rows
into their slots; a quantized cache (kernels/quant.py) stores each token's head
row quantized with its scale (and zero point) beside it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import quant
from kernels.quant import KVScales, checked_scales
from kernels.triton.kv_quant import quantize_rows, scale_pointers, to_cache


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_quant_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_zero_ptr,
    v_zero_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_cd,  # k_cache and v_cache share a layout (asserted)
    stride_sb,
    stride_sh,
    stride_ss,  # so do the scales and zero points
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,  # 1 = FP8 e4m3, 2 = INT8 (kernels/quant.py)
):
    # A program quantizes BLOCK_T tokens of one KV head: a row is one token's head
    # vector, whose absmax (or min/max) gives the scale stored at the token's slot.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    dim = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    row_ok = slot >= 0
    keep = row_ok[:, None] & (dim < HEAD_DIM)[None, :]
    tok64 = tok.to(tl.int64)[:, None]
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = (block * stride_cb + head * stride_ch + offset * stride_cs)[:, None] + (dim * stride_cd)[None, :]
    scale_dst = block * stride_sb + head * stride_sh + offset * stride_ss
    k = tl.load(key_ptr + tok64 * stride_kt + (head * stride_kh + dim * stride_kd)[None, :], mask=keep, other=0.0)
    q, scale, zero = quantize_rows(k.to(tl.float32), QUANT)
    tl.store(k_cache_ptr + dst, q.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(k_scale_ptr + scale_dst, scale, mask=row_ok)
    if QUANT == 2:
        tl.store(k_zero_ptr + scale_dst, zero.to(k_zero_ptr.dtype.element_ty), mask=row_ok)
    v = tl.load(value_ptr + tok64 * stride_vt + (head * stride_vh + dim * stride_vd)[None, :], mask=keep, other=0.0)
    q, scale, zero = quantize_rows(v.to(tl.float32), QUANT)
    tl.store(v_cache_ptr + dst, q.to(v_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(v_scale_ptr + scale_dst, scale, mask=row_ok)
    if QUANT == 2:
        tl.store(v_zero_ptr + scale_dst, zero.to(v_zero_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_cd,  # k_cache and v_cache share a layout (asserted)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HD: tl.constexpr,
):
    # A program writes BLOCK_T tokens; the columns are (kv head, dim) flattened.
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_HD)
    head, dim = col // HEAD_DIM, col % HEAD_DIM
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    keep = (slot >= 0)[:, None] & (col < NUM_KV_HEADS * HEAD_DIM)[None, :]
    # int64 offsets: a large pool passes 2^31 elements.
    tok64 = tok.to(tl.int64)[:, None]
    dst = (slot // BLOCK_SIZE * stride_cb + slot % BLOCK_SIZE * stride_cs)[:, None] + (
        head * stride_ch + dim * stride_cd
    )[None, :]
    k = tl.load(key_ptr + tok64 * stride_kt + (head * stride_kh + dim * stride_kd)[None, :], mask=keep, other=0.0)
    v = tl.load(value_ptr + tok64 * stride_vt + (head * stride_vh + dim * stride_vd)[None, :], mask=keep, other=0.0)
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr), mask=keep)
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr), mask=keep)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scales: KVScales | None = None,
) -> None:
    """Scatter key/value [T, kv_heads, head_dim] into the cache at slot_mapping [T];
    slots < 0 are skipped. A quantized cache (FP8/INT8) quantizes each token per
    KV head and writes its scale (and zero point) at the same slot."""
    num_tokens = key.shape[0]
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    scales = checked_scales(k_cache, v_cache, scales)
    if num_tokens == 0:
        return
    if scales is not None:
        k_scale, v_scale, k_zero, v_zero = scale_pointers(scales)
        block_d = triton.next_power_of_2(head_dim)
        block_t = max(1, min(16, 4096 // block_d, triton.next_power_of_2(num_tokens)))
        _write_kv_quant_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
            key,
            value,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            k_zero,
            v_zero,
            slot_mapping,
            num_tokens,
            *key.stride(),
            *value.stride(),
            *k_cache.stride(),
            *k_scale.stride(),
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            QUANT=quant.quant_code(k_cache.dtype),
        )
        return
    block_hd = triton.next_power_of_2(num_kv_heads * head_dim)
    block_t = max(1, min(16, 4096 // block_hd, triton.next_power_of_2(num_tokens)))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        BLOCK_T=block_t,
        BLOCK_HD=block_hd,
    )
