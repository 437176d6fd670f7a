"""The paged attention kernel body (`paged_attention_kernel`) and the split-KV
merge (`merge_splits_kernel`); attention.py launches them (its docstring has the
design)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton.kv_quant import from_cache


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
def paged_attention_kernel(
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
    qk_scale,  # scale * log2(e): the softmax runs in base 2; SOFTCAP: scale / softcap
    cap_scale,  # SOFTCAP: softcap * log2(e), the capped scores' factor (else unused)
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
    SOFTCAP: tl.constexpr,  # scores capped: softcap * tanh(scores / softcap) (Gemma 2)
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
        k = from_cache(k, k_scale_ptr, k_zero_ptr, scale_off, kv_ok, COMPUTE, QUANT)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # tanh(x) = 2 * sigmoid(2x) - 1
            s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_scale
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
        v = from_cache(v, v_scale_ptr, v_zero_ptr, scale_off, kv_ok, COMPUTE, QUANT)
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
def merge_splits_kernel(
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
