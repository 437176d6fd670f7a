"""Triton kernels over the paged KV cache, one per op of kernels/reference.py and
with the same signatures and semantics (that module's docstring has the cache
layout and the varlen conventions).

* ``write_kv``: scatter this step's K/V rows into their slots.
* ``paged_decode_attention`` / ``paged_prefill_attention``: one kernel body
  (``_paged_attention_kernel``) that reads K/V straight from the blocks through
  the block table with an online softmax in fp32. A program owns one KV head and
  a tile of query *rows*, where a row is a (token, query head of that KV head's
  group) pair, so GQA/MQA load each K/V tile once for the whole group and both
  matmuls are ``tl.dot`` on [BLOCK_M, ...] tiles (BLOCK_M >= 16, the group is
  padded up to it). Decode is the one-token case: grid (sequence, kv head).
* Split-KV (flash-decoding) decode: when (sequence, KV head) programs cannot fill
  the SMs (``num_kv_splits``), a third grid axis cuts each sequence's visible KV
  tiles into equal partitions; each program writes its unnormalized output, max
  and sum-exp (fp32), and ``_merge_splits_kernel`` combines them per (sequence,
  query head) with a log-sum-exp reduction. Same kernel body (GQA, windows,
  dequantization unchanged), only the loop's range and the final store differ.
* Sliding window: the KV loop starts at the KV tile holding the first position
  any row of the tile can see, so tiles wholly outside the window are never
  visited; the loads are also masked to that range, so no slot outside it is read.
* Quantized caches (FP8 e4m3 / INT8 with per-token-per-head scales, the math in
  kernels/quant.py): ``_write_kv_quant_kernel`` quantizes each token's head row
  and stores its scale (and zero point) beside it (``_to_cache``); the attention
  kernel dequantizes every K/V tile it loads (``_from_cache``). The ``QUANT``
  constexpr selects the path, so the unquantized kernels compile as before.
  FP8 rounding is done in fp32 arithmetic (``_round_e4m3``), not by the cast:
  the interpreter's fp32 -> fp8 cast mis-rounds (e.g. 126.6 -> 64), and the
  explicit round-to-nearest-even gives the bits torch's cast gives, everywhere.

Kernels run compiled on CUDA (matmuls in the query dtype, fp32 accumulation), or
under the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1`` set before
this module is imported, as tests/conftest.py does). Under the interpreter
everything is cast to fp32 right after loading: its bf16 arithmetic works on the
raw uint16 bits and is garbage otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import quant, reference
from kernels.quant import KVScales, checked_scales

LOG2E = 1.4426950408889634


def interpreter_enabled() -> bool:
    """True when @triton.jit functions in this process run in the interpreter."""
    return bool(triton.knobs.runtime.interpret)


_INTERPRET = interpreter_enabled()  # fixed at import, as the @triton.jit decorators below are


# --------------------------------------------------------------------------- write_kv


@triton.jit
def _to_cache(x, cache_ptr):
    # The write of an unquantized cache: a plain cast to the cache dtype. The
    # quantized caches go through _quantize_rows below.
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _round_e4m3(y):
    """fp32 |y| <= 448 -> the nearest float8 e4m3 value (ties to even), still in fp32.

    The step of e4m3 around y is 2^(e - 3) for y's binary exponent e >= -6 and the
    subnormal step 2^-9 below; scaling by powers of two is exact, and adding and
    subtracting 1.5 * 2^23 rounds an fp32 below 2^22 to an integer, ties to even.
    The sign is put back from y's sign bit, so -0.0 and tiny negatives give -0 as
    torch's cast does."""
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - (exp - 3)) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * inv_step + 12582912.0) - 12582912.0) * step
    return tl.where(bits < 0, -r, r)


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr):
    """Rows of fp32 x [BLOCK_T, BLOCK_D] (padding columns hold 0) -> (q in fp32,
    scale [BLOCK_T], zero point [BLOCK_T] in fp32; 0 for FP8): the fp32 operations
    of kernels/quant.py, in its order, so that a compiled write stores the bits the
    torch reference stores. Every division is tl.math.div_rn: Triton's ``/`` on fp32
    lowers to the approximate div.full.f32 on NVIDIA GPUs (the interpreter, dividing
    in numpy, hides the difference), and quant._div makes torch's side the IEEE
    quotient too. INT8 rounds with floor(y + 0.5) exactly as quant._round does
    (torch.round would round half to even), and clamps after adding the zero point,
    as the reference does."""
    if QUANT == 1:  # FP8 e4m3, symmetric
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 448.0)
        safe = tl.where(scale > 0, scale, 1.0)
        y = tl.math.div_rn(x, safe[:, None])
        q = _round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        zero = tl.zeros_like(scale)
    else:  # INT8 with a zero point; the range holds 0
        lo = tl.minimum(tl.min(x, axis=1), 0.0)
        hi = tl.maximum(tl.max(x, axis=1), 0.0)
        scale = tl.math.div_rn(hi - lo, 255.0)
        safe = tl.where(scale > 0, scale, 1.0)
        zero = tl.minimum(tl.maximum(-128.0 - tl.floor(tl.math.div_rn(lo, safe) + 0.5), -128.0), 127.0)
        q = tl.floor(tl.math.div_rn(x, safe[:, None]) + 0.5) + zero[:, None]
        q = tl.minimum(tl.maximum(q, -128.0), 127.0)
    return q, scale, zero


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
    q, scale, zero = _quantize_rows(k.to(tl.float32), QUANT)
    tl.store(k_cache_ptr + dst, q.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(k_scale_ptr + scale_dst, scale, mask=row_ok)
    if QUANT == 2:
        tl.store(k_zero_ptr + scale_dst, zero.to(k_zero_ptr.dtype.element_ty), mask=row_ok)
    v = tl.load(value_ptr + tok64 * stride_vt + (head * stride_vh + dim * stride_vd)[None, :], mask=keep, other=0.0)
    q, scale, zero = _quantize_rows(v.to(tl.float32), QUANT)
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
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr), mask=keep)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr), mask=keep)


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
        k_scale, v_scale, k_zero, v_zero = _scale_pointers(scales)
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


# --------------------------------------------------------------------------- attention


@triton.jit
def _from_cache(x, scale_ptr, zero_ptr, scale_off, mask, COMPUTE: tl.constexpr, QUANT: tl.constexpr):
    # The dequantizing read (the mirror of _quantize_rows): x is a [BLOCK_N, BLOCK_D]
    # K or V tile; an FP8/INT8 cache scales row n by the scale (minus the zero
    # point) stored for its position at scale_off[n]. fp32, then the compute dtype,
    # as kernels/quant.py and the reference do.
    if QUANT == 0:
        return x.to(COMPUTE)
    else:
        values = x.to(tl.float32)
        if QUANT == 2:
            values = values - tl.load(zero_ptr + scale_off, mask=mask, other=0).to(tl.float32)[:, None]
        return (values * tl.load(scale_ptr + scale_off, mask=mask, other=0.0)[:, None]).to(COMPUTE)


@triton.jit
def _find_seq(cu_query_lens_ptr, tile_idx, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning flat query tile ``tile_idx``: sequence s's tiles are
    numbered from ``cu_query_lens[s] // BLOCK_Q + 2 * s`` (a layout that never
    overlaps, leaves room for the extra tile of position-aligned tiles and needs
    no prefix sum of tile counts); binary search for the last s whose first tile
    is <= tile_idx."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_query_lens_ptr + mid) // BLOCK_Q + 2 * mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Values that change from step to step are not specialised on (Triton would compile
# a variant per value == 1 or divisible by 16): the worker compiles every variant
# it needs before serving (worker_svc/runner/warm_up.py), which needs a small, known set.
@triton.jit(do_not_specialize=["sliding_window", "num_seqs", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    cu_query_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_zero_ptr,
    v_zero_ptr,  # read only when QUANT > 0
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,  # split-KV partials, written only when SPLIT
    qk_scale,  # scale * log2(e): the softmax runs in base 2
    sliding_window,
    num_seqs,
    num_splits,  # SPLIT: partitions of each sequence's context (program axis 2)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_cd,  # k_cache and v_cache share a layout (asserted)
    stride_bt,
    stride_sb,
    stride_sh,
    stride_ss,  # the scales and zero points share one too
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # query rows per program: BLOCK_Q tokens x GROUP heads, padded
    BLOCK_Q: tl.constexpr,  # query tokens per program (BLOCK_M // GROUP)
    BLOCK_N: tl.constexpr,  # KV positions per loop iteration
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    DECODE: tl.constexpr,  # one query token per sequence: program 0 axis is the sequence
    SLIDING: tl.constexpr,  # sliding_window > 0
    COMPUTE: tl.constexpr,  # dtype of the tl.dot inputs (accumulation is fp32)
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # cache: 0 = unquantized, 1 = FP8 e4m3, 2 = INT8 (kernels/quant.py)
    SPLIT: tl.constexpr,  # decode only: this program covers one partition and writes partials
    MIN_SPLIT_TILES: tl.constexpr,  # SPLIT: a sequence takes at most cdiv(its tiles, this) partitions; 0: num_splits
):
    kv_head = tl.program_id(1)
    if DECODE:
        seq = tl.program_id(0)
        q_start = seq
        q_len = 1
        tile = 0
    else:
        seq = _find_seq(cu_query_lens_ptr, tl.program_id(0), num_seqs, BLOCK_Q)
        q_start = tl.load(cu_query_lens_ptr + seq)
        q_len = tl.load(cu_query_lens_ptr + seq + 1) - q_start
        tile = tl.program_id(0) - (q_start // BLOCK_Q + 2 * seq)
    ctx_len = tl.load(context_lens_ptr + seq)
    # Prefill tiles start at positions that are multiples of BLOCK_Q, whatever the
    # chunk's first position: a token then lands in the same tile row, with the same
    # KV loop, however its prompt was chunked or however much of it the prefix cache
    # held, so its output does not depend on that (tl.dot's rounding may depend on
    # the row, as the interpreter's BLAS does). The first tile of a chunk is partial.
    shift = 0 if DECODE else (ctx_len - q_len) % BLOCK_Q
    if tile * BLOCK_Q - shift >= q_len:  # slack tile of the flat numbering
        return

    # Rows: (token of this tile, query head of this KV head's group).
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP - shift
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok >= 0) & (tok < q_len)
    q_pos = ctx_len - q_len + tok  # the new tokens are the last q_len of the context
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    row64 = (q_start + tok).to(tl.int64)
    q_off = row64[:, None] * stride_qt + (head * stride_qh)[:, None] + (dims * stride_qd)[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(COMPUTE)

    # KV positions any row of the tile can see: [kv_start, kv_end). The loop starts
    # at the KV tile holding kv_start, so tiles wholly before the window are never
    # visited, and the loads are masked to the range, so no position outside it is
    # read. KV tiles sit at multiples of BLOCK_N, so every row sees its keys in the
    # same tiles whatever its chunk; the tiles a row cannot see before or after its
    # own leave its softmax state exactly as it was (alpha = 1 or 0, p = 0).
    first_pos = ctx_len - q_len + tile * BLOCK_Q - shift
    kv_end = tl.minimum(ctx_len, first_pos + BLOCK_Q)
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(tl.maximum(first_pos, ctx_len - q_len) - sliding_window + 1, 0)
    head_off = kv_head.to(tl.int64) * stride_ch
    scale_head_off = kv_head.to(tl.int64) * stride_sh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    loop_start = kv_start // BLOCK_N * BLOCK_N
    loop_end = kv_end
    if SPLIT:
        # Split-KV: partition p of P takes an equal share of the KV tiles this
        # sequence visits, so every length is split evenly (no host-side maximum
        # needed) and the partitions meet at tile edges: each position is in one.
        # The count is the sequence's own: P (the grid's, from the longest context
        # the table can hold) capped so no partition is shorter than
        # MIN_SPLIT_TILES tiles; the programs past it find their range empty and
        # write the partials of an empty partition, which the merge weighs 0.
        split = tl.program_id(2)
        tiles = tl.cdiv(kv_end, BLOCK_N) - kv_start // BLOCK_N
        splits = num_splits
        if MIN_SPLIT_TILES > 0:
            splits = tl.minimum(splits, tl.maximum(tl.cdiv(tiles, MIN_SPLIT_TILES), 1))
        per_split = tl.cdiv(tiles, splits)
        loop_start = loop_start + split * per_split * BLOCK_N
        loop_end = tl.minimum(kv_end, loop_start + per_split * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(loop_start, loop_end, BLOCK_N):
        kv_pos = n0 + tl.arange(0, BLOCK_N)
        kv_ok = (kv_pos >= kv_start) & (kv_pos < kv_end)
        # Per-position block lookup: a tile spans BLOCK_N // BLOCK_SIZE blocks (or part of one).
        block = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + head_off + (kv_pos % BLOCK_SIZE) * stride_cs
        scale_off = block * stride_sb + scale_head_off + (kv_pos % BLOCK_SIZE) * stride_ss
        load_ok = kv_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + (dims * stride_cd)[None, :], mask=load_ok, other=0.0)
        k = _from_cache(k, k_scale_ptr, k_zero_ptr, scale_off, kv_ok, COMPUTE, QUANT)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        visible = kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))

        # Online softmax. A row that has seen nothing yet has max -inf: subtract 0
        # instead so that exp2 gives 0, not NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + (dims * stride_cd)[None, :], mask=load_ok, other=0.0)
        v = _from_cache(v, v_scale_ptr, v_zero_ptr, scale_off, kv_ok, COMPUTE, QUANT)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if SPLIT:
        # Unnormalized partials, fp32: [seq, q head, split, dim] and [seq, q head, split]
        # (m in the base-2 domain); an empty partition leaves -inf, 0, 0.
        part = (row64 * (tl.num_programs(1) * GROUP) + head) * num_splits + tl.program_id(2)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        p_off = part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(part_out_ptr + p_off, acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i == 0 only on padding rows
        o_off = row64[:, None] * stride_ot + (head * stride_oh)[:, None] + (dims * stride_od)[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
):
    # One program per (sequence, query head): the log-sum-exp merge of its
    # partitions, out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p with M the
    # largest m_p. Empty partitions (m = -inf) weigh 0; a row with no partition
    # holding anything (M = -inf) gets 0, as the single-pass kernel gives it.
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM
    part = (seq * tl.num_programs(1) + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=split_ok, other=float("-inf"))
    sum_exp = tl.load(part_sum_ptr + part, mask=split_ok, other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.math.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))
    # Masked lanes must load 0, not whatever the hardware leaves there: a NaN times
    # weight 0 is still NaN.
    acc_ok = split_ok[:, None] & dim_ok[None, :]
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=acc_ok, other=0.0)
    total = tl.sum(sum_exp * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_off = seq * stride_ot + head * stride_oh + dims * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# The most shared memory one block may use (the opt-in limit), by compute capability.
SHARED_MEMORY_PER_BLOCK = {
    (7, 5): 65536,
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
    (10, 0): 232448,
    (12, 0): 101376,
}
# Where no GPU says which (the interpreter): the tiles a Hopper part would run.
DEFAULT_CAPABILITY = (9, 0)


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    block_m: int  # query rows ((token, query head) pairs) per program
    block_n: int  # KV positions per loop iteration
    num_warps: int
    num_stages: int  # software-pipelining depth of the KV loop


def attention_tiles(
    head_dim: int, group: int, decode: bool, capability: tuple[int, int], operand_bytes: int, quantized: bool
) -> AttentionTiles:
    """The tiles of _paged_attention_kernel for a head_dim on an architecture.

    Registers bound them first: a thread holds BLOCK_N x BLOCK_D / (32 x warps)
    elements of each K/V tile with one 64-bit address each (the paged gather),
    and a prefill thread also BLOCK_M x BLOCK_D / (32 x warps) of the fp32
    accumulator; past ~48 elements ptxas spills (measured at head_dim 64/128/256
    on sm_80 and sm_90 with bench/kernel_resources.py; the 64 x 64 tiles used
    for every head_dim before spilled from head_dim 64 on). So wider heads get
    more warps and shorter KV tiles; fp32 operands and the dequantizing read
    (FP8/INT8: scales, conversions) take more registers, so half again. Then the
    architecture: before sm_80 (no asynchronous copies, 64 KB of shared memory)
    two pipeline stages, else three; the largest choice takes ~72 KB of shared
    memory, within sm_86/89's 99 KB. tests/unit/test_kernel_resources.py compiles
    the choices for sm_80, sm_86 and sm_90 and checks shared memory, registers and
    spills."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = operand_bytes >= 4
    if decode:
        # The group padded up to >= 16 rows, the smallest MMA tile (older Tritons
        # refuse smaller tl.dot operands outright).
        block_m = max(16, triton.next_power_of_2(group))
        num_warps = 4 if block_d <= 128 else 8
    else:  # at least the group: a program holds whole groups (BLOCK_Q tokens)
        # 16 rows at head_dim 256 for fp32 too: 32 x 16 spilled 4 bytes on sm_80 under
        # Triton 3.6 (bench/results/gpu_check.md).
        narrow = (quantized or wide) and block_d >= 256
        block_m = 64 if block_d <= 128 and not (wide or quantized) else 16 if narrow else 32
        block_m = max(block_m, triton.next_power_of_2(group))
        num_warps = 8
    block_n = 64 if block_d <= 64 else 32
    if wide or (quantized and (decode or block_d >= 256)):
        block_n //= 2
    num_stages = 3 if capability >= (8, 0) else 2
    return AttentionTiles(block_m, max(16, block_n), num_warps, num_stages)


_CAPABILITIES: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (cached); DEFAULT_CAPABILITY elsewhere."""
    if device.type != "cuda":
        return DEFAULT_CAPABILITY
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def attention_launch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    decode: bool,
    sliding: bool,
    capability: tuple[int, int] = DEFAULT_CAPABILITY,
    interpret: bool = _INTERPRET,
    split: bool = False,
    min_split_tokens: int = 0,
) -> tuple[dict[str, object], dict[str, int]]:
    """The compile-time parameters of _paged_attention_kernel for one launch shape,
    and its launch options (warps, stages). `min_split_tokens` (split only): the
    shortest partition a sequence is cut into (0: exactly num_splits each)."""
    group = num_heads // num_kv_heads
    quantized = quant.quant_code(cache_dtype) > 0
    tiles = attention_tiles(head_dim, group, decode, capability, query_dtype.itemsize, quantized)
    # The matmuls run in the query dtype with fp32 accumulation (K/V are cast to it,
    # as the reference does); all fp32 under the interpreter, whose bf16 is broken.
    compute = tl.float32 if interpret else _TL_DTYPES[query_dtype]
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_m // group,  # a prefill program's tokens
        BLOCK_N=tiles.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DECODE=decode,
        SLIDING=sliding,
        COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else None,  # no TF32 for fp32 models
        QUANT=quant.quant_code(cache_dtype),
        SPLIT=split,
        MIN_SPLIT_TILES=-(-min_split_tokens // tiles.block_n) if split else 0,
    )
    return constexprs, {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}


# Split-KV (flash-decoding) heuristic. A decode program owns one (sequence, KV
# head) and streams that head's whole context; with fewer programs than SMs most
# of the GPU idles (1 sequence x 8 KV heads on a 132-SM H100 read a 32k context at
# ~5 % of the copy bandwidth). Splitting each context into P partitions makes
# P times as many programs, at the cost of a second (small) merge kernel.
PROGRAMS_PER_SM = 4  # programs in flight per SM that the split aims for (4 warps each)
MIN_SPLIT_TOKENS = 256  # a partition streams at least this many positions (4 KV tiles)
MAX_SPLITS = 64


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Partitions per sequence for a decode launch: as many as keep the programs
    within PROGRAMS_PER_SM per SM (so 1 once the (sequence, KV head) programs alone
    reach that), no partition shorter than MIN_SPLIT_TOKENS of max_context, at most
    MAX_SPLITS, rounded down to a power of two (one merge-kernel specialisation
    per power)."""
    programs = num_seqs * num_kv_heads
    if programs == 0:
        return 1
    wanted = min(PROGRAMS_PER_SM * num_sms // programs, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return 1 << (max(wanted, 1).bit_length() - 1)


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere, which means no
    split (the interpreter runs programs one after another: splitting only adds work)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _scale_pointers(scales: KVScales) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' four scale pointer arguments: FP8 has no zero points, and their
    slots get the scales (never read). All four share one layout."""
    k_zero = scales.k_scale if scales.k_zero is None else scales.k_zero
    v_zero = scales.v_scale if scales.v_zero is None else scales.v_zero
    pointers = (scales.k_scale, scales.v_scale, k_zero, v_zero)
    assert len({t.stride() for t in pointers}) == 1, [t.stride() for t in pointers]
    return pointers


def _launch_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_query_lens: Tensor,
    scale: float,
    sliding_window: int,
    decode: bool,
    scales: KVScales | None = None,
    num_splits: int = 1,
    min_split_tokens: int = 0,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.shape[-1] == head_dim, (query.shape, k_cache.shape)
    num_seqs = block_tables.shape[0]
    assert not decode or num_tokens == num_seqs, "decode takes one query token per sequence"
    assert num_splits >= 1 and (decode or num_splits == 1), f"num_splits {num_splits} (> 1 is for decode)"
    scales = checked_scales(k_cache, v_cache, scales)
    if scales is not None:
        scale_pointers, scale_strides = _scale_pointers(scales), scales.k_scale.stride()
    else:  # the pointer slots take any tensor; they are never read
        scale_pointers, scale_strides = (k_cache, v_cache, k_cache, v_cache), (0, 0, 0)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    split = num_splits > 1
    meta, options = attention_launch(
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        query.dtype,
        k_cache.dtype,
        decode,
        sliding_window > 0,
        device_capability(query.device),
        split=split,
        min_split_tokens=min_split_tokens,
    )
    # Decode: a program per (sequence, kv head[, partition]). Prefill: flat query
    # tiles (see _find_seq), an upper bound on their number that needs no device sync.
    if split:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_max = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        grid: tuple[int, ...] = (num_seqs, num_kv_heads, num_splits)
    else:  # the partial slots take any tensor; they are never written
        part_out = part_max = part_sum = out
        block_q = meta["BLOCK_Q"]
        assert isinstance(block_q, int)
        grid = (num_seqs if decode else num_tokens // block_q + 2 * num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_query_lens,
        *scale_pointers,
        part_out,
        part_max,
        part_sum,
        scale * LOG2E,
        sliding_window,
        num_seqs,
        num_splits,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        *scale_strides,
        **meta,
        **options,
    )
    if split:
        _merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=meta["BLOCK_D"],
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    query [T, q_heads, d]; block_tables [S, max_blocks]; cu_query_lens [S + 1];
    context_lens [S] (cached + new tokens). A token at position p sees positions
    j <= p, and with a sliding window W > 0 only j > p - W. Returns [T, q_heads, d]
    in query's dtype. A quantized cache is read through its `scales`."""
    return _launch_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_query_lens,
        scale,
        sliding_window,
        decode=False,
        scales=scales,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """One query token per sequence (the last of its context_lens[s] tokens).

    query [S, q_heads, d] -> [S, q_heads, d]. Split-KV when the (sequence, KV
    head) programs cannot fill the GPU (num_kv_splits); the table's width bounds
    every context, so the grid needs no device sync, and each sequence takes only
    as many of those partitions as its own length fills (MIN_SPLIT_TOKENS each):
    a captured graph's table is as wide as max_model_len, its sequences are not."""
    num_splits = num_kv_splits(
        block_tables.shape[0], k_cache.shape[1], block_tables.shape[1] * k_cache.shape[2], num_sms(query.device)
    )
    return split_kv_decode_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        sliding_window,
        num_splits=num_splits,
        scales=scales,
        min_split_tokens=MIN_SPLIT_TOKENS,
    )


def split_kv_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    num_splits: int,
    scales: KVScales | None = None,
    min_split_tokens: int = 0,
) -> torch.Tensor:
    """paged_decode_attention with each sequence's visible context cut into
    num_splits partitions of whole KV tiles, one program each, merged by a second
    kernel (log-sum-exp). num_splits 1 is the single-pass kernel. With
    min_split_tokens, a sequence takes fewer partitions where its own context
    would make them shorter than that (0: exactly num_splits)."""
    # cu_query_lens is unused in decode mode; any tensor fills the pointer slot.
    return _launch_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens,
        scale,
        sliding_window,
        decode=True,
        scales=scales,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
    )


def contiguous_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """reference.contiguous_prefill_attention: a contiguous cache [max_batch, kv_heads,
    max_seq_len, d] is a paged one whose blocks are max_seq_len long, one per
    sequence, so the paged kernel reads each slot directly through a 1-entry table."""
    table = slots.to(torch.int32).reshape(-1, 1)
    return _launch_attention(
        query,
        k_cache,
        v_cache,
        table,
        context_lens,
        cu_query_lens,
        scale,
        sliding_window,
        decode=False,
        scales=scales,
    )


def contiguous_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """reference.contiguous_decode_attention (see contiguous_prefill_attention);
    split-KV as paged_decode_attention chooses it (a slot is max_seq_len long)."""
    table = slots.to(torch.int32).reshape(-1, 1)
    return paged_decode_attention(
        query,
        k_cache,
        v_cache,
        table,
        context_lens,
        scale,
        sliding_window,
        scales=scales,
    )


# --------------------------------------------------------------------------- sampling


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    keys_ptr,
    thresholds_ptr,
    out_ptr,
    vocab,
    stride_row,
    MUL_A: tl.constexpr,
    MUL_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per row, one pass over its logits: each tile's scaled logits get
    # their noise (reference.gumbel's hash, in uint32 lanes whose products wrap as
    # the reference's masked int64 ones do) and the row keeps the best score so far
    # and its token; ties to the lowest id (first tile, then tl.argmax's left tie).
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    threshold = tl.load(thresholds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_token = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        tokens = start + tl.arange(0, BLOCK_V)
        ok = tokens < vocab
        logits = tl.load(row_ptr + tokens, mask=ok, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(logits, temperature)  # IEEE, as torch divides
        h = key ^ tokens.to(tl.uint32)
        h = h ^ (h >> 16)
        h = h * MUL_A
        h = h ^ (h >> 15)
        h = h * MUL_B
        h = h ^ (h >> 16)
        uniform = ((h >> 9).to(tl.int32).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        noise = -tl.log(-tl.log(uniform))
        score = tl.where(ok & (scaled >= threshold), scaled + noise, float("-inf"))
        tile_best = tl.max(score, 0)
        tile_token = start + tl.argmax(score, 0)
        better = tile_best > best
        best_token = tl.where(better, tile_token, best_token)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_token.to(tl.int64))


def gumbel_argmax(logits: Tensor, temperature: Tensor, keys: Tensor, thresholds: Tensor) -> Tensor:
    """reference.gumbel_argmax in one pass over the logits: no [N, V] temporaries
    (the reference hashes in int64 lanes, ~20 passes)."""
    num_rows, vocab = logits.shape
    assert temperature.shape == keys.shape == thresholds.shape == (num_rows,), (logits.shape, temperature.shape)
    assert logits.stride(-1) == 1, logits.stride()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block_v = min(2048, triton.next_power_of_2(vocab))
    _gumbel_argmax_kernel[(num_rows,)](
        logits,
        temperature.float().contiguous(),
        keys.contiguous(),
        thresholds.float().contiguous(),
        out,
        vocab,
        logits.stride(0),
        MUL_A=tl.constexpr(reference.HASH_MULTIPLIERS[0]),
        MUL_B=tl.constexpr(reference.HASH_MULTIPLIERS[1]),
        BLOCK_V=block_v,
    )
    return out


# Whole-block copies (values, and the scales of a quantized cache) are plain
# tensor indexing: no kernel needed.
copy_blocks = reference.copy_blocks


__all__ = [
    "interpreter_enabled",
    "write_kv",
    "paged_decode_attention",
    "split_kv_decode_attention",
    "num_kv_splits",
    "paged_prefill_attention",
    "copy_blocks",
    "contiguous_decode_attention",
    "contiguous_prefill_attention",
    "gumbel_argmax",
]


# --------------------------------------------------------------------------- fused element-wise ops
# A decoder layer's element-wise work as two kernels (issue 27, fault 9), with
# kernels/reference.py's semantics: add_rms_norm (the residual add and the next RMSNorm:
# one program per row instead of three kernels) and rope_write_kv (RoPE on q and k and
# the K/V write: one program per token instead of ~12 kernels per layer). They round
# once from fp32, where the reference rounds after every op in a narrow dtype.


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
            tl.store(k_cache_ptr + dst, _to_cache(a.to(tl.float32), k_cache_ptr), mask=mask)
            tl.store(k_cache_ptr + dst + HALF, _to_cache(b.to(tl.float32), k_cache_ptr), mask=mask)
            v_row = v_ptr + tok * stride_vt + head * stride_vh + dim
            v1 = tl.load(v_row, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(v_row + HALF, mask=mask, other=0.0).to(tl.float32)
            tl.store(v_cache_ptr + dst, _to_cache(v1, v_cache_ptr), mask=mask)
            tl.store(v_cache_ptr + dst + HALF, _to_cache(v2, v_cache_ptr), mask=mask)


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


__all__ += ["add_rms_norm", "rope_write_kv"]
