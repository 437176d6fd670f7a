"""x @ W.T over GGUF's quantized blocks in Triton (kernels/gguf_quant.py's
quant_linear, the oracle; tested under TRITON_INTERPRET=1): the blocks are read
as the file has them (QuantizedWeight.data, uint8 rows) and decoded inside the K
loop, so no dequantized copy of the weight is ever made.

Each weight element W[n, k] is decoded where it is needed (`_decode`): its block
is block k // E of row n, and its quantized bits, its block's fp16 scales
and, for the K-quants, its sub-block's 6-bit scale and min are gathered from
that block's bytes with the format's arithmetic (the reference's fp32 operations
in the reference's order, never fused: `launch_options`). Neighbouring
lanes read neighbouring bytes of one row and share their block's scales, which
the cache serves once.

Two kernels over that decode, the choice and the tiles pure arithmetic
(`gguf_tiles`):
* GEMV (few tokens, decode): one program per (BLOCK_N output rows, token), a
  [BLOCK_N, BLOCK_K] tile of decoded weights (rounded to x's dtype) times the
  token's slice of x, summed along K in fp32. No padding of the token dimension to an MMA tile.
* GEMM (prefill, batched decode): one program per (BLOCK_M tokens, BLOCK_N
  outputs), the decoded [BLOCK_K, BLOCK_N] tile rounded to x's dtype (as the
  reference rounds the dequantized weight) and multiplied with tl.dot, fp32
  accumulation; fp32 models use IEEE fp32 dots (no TF32), and so does the
  interpreter, whose bf16 arithmetic is broken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from kernels.triton.common import INTERPRET, TL_DTYPES

# The formats the kernels decode, by the code `_decode` branches on.
QTYPE_CODES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4, "Q4_K": 5, "Q5_K": 6, "Q6_K": 7}
# Tokens up to which a launch takes the GEMV: past it the GEMV would decode the
# weight once per token, while the GEMM decodes it once per BLOCK_M tokens.
GEMV_MAX_TOKENS = 4


@dataclass(frozen=True, slots=True)
class GgufTiles:
    gemv: bool
    block_m: int  # tokens per program (1: the GEMV)
    block_n: int  # output features per program
    block_k: int  # input features per loop iteration, a multiple of 32 (every format's sub-block)
    num_warps: int
    num_stages: int


def gguf_tiles(tokens: int, qtype: str) -> GgufTiles:
    """The kernel and tiles for `tokens` rows of x. A decode step reads every weight
    once, so the GEMV spreads the rows over many programs (a 4,096-row output is 512
    programs of 8 rows) and reads 128 weights per row and iteration (half a K-quant
    super-block, 4 blocks of the others; 256 spilled Q5_K on sm_90). The GEMM's
    token tile grows with the tokens (16 rows, the smallest MMA tile, for a small
    batch; 128 for a prefill) over 64 outputs and one 32-element sub-block per
    iteration: every decoded weight holds a gathered address, and larger tiles
    spilled registers (128 x 128 x 64 on sm_90: up to 740 bytes for Q5_K;
    128 x 128 x 32 on sm_80: 24 bytes for Q5_1). These spill nothing on sm_80 and
    sm_90 (tests/unit/test_gguf_triton.py, slow). GPU tuning (a split-K GEMV for
    narrow outputs, a grouped launch order for L2) is still to measure
    (bench/gguf_gemm.py)."""
    if qtype not in QTYPE_CODES:
        raise ValueError(f"the Triton GGUF kernels do not decode {qtype} (they do: {', '.join(QTYPE_CODES)})")
    if tokens <= GEMV_MAX_TOKENS:
        return GgufTiles(True, 1, 8, 128, num_warps=4, num_stages=2)
    if tokens <= 64:
        return GgufTiles(False, 16 if tokens <= 16 else 32, 64, 32, num_warps=4, num_stages=3)
    return GgufTiles(False, 128 if tokens >= 1024 else 64, 64, 32, num_warps=8, num_stages=3)


def launch_options(tiles: GgufTiles) -> dict[str, int]:
    """Warps and stages, and no fused multiply-adds: the decode's d * q + m and
    d * q - dmin * mn then round as the reference's do (exact decoded weights, as the
    C++ kernel's contraction off gives); the dots run on the MMA units regardless."""
    return {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages, "enable_fp_fusion": False}


@triton.jit
def _byte(w_ptr, offset, mask):
    return tl.load(w_ptr + offset, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(h_ptr, offset, mask):
    """The fp16 at byte `offset` (even: every scale field sits at an even offset of
    blocks of even size) as fp32."""
    return tl.load(h_ptr + offset // 2, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _k_scale_min(w_ptr, scales, s, mask):
    """Q4_K/Q5_K's 6-bit scale and min of sub-block s from the 12 bytes at `scales`
    (kernels/gguf_quant.py's k_scale_min)."""
    t = s % 4
    b_d = _byte(w_ptr, scales + t, mask)
    b_m = _byte(w_ptr, scales + t + 4, mask)
    b_md = _byte(w_ptr, scales + t + 8, mask)
    low = s < 4
    sc = tl.where(low, b_d & 63, (b_md & 15) | ((b_d >> 2) & 48))
    mn = tl.where(low, b_m & 63, (b_md >> 4) | ((b_m >> 2) & 48))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _decode(w_ptr, h_ptr, n, k, mask, row_bytes, QTYPE: tl.constexpr, E: tl.constexpr, B: tl.constexpr):
    """fp32 W[n, k] (n and k broadcast to one shape) from the rows at w_ptr (uint8)
    and h_ptr (the same bytes as fp16), as kernels/gguf_quant.py decodes them; a
    block holds E weights in B bytes. Offsets are int32 from the program's first
    row (the launcher points there), so the many gathered addresses stay small."""
    base = n * row_bytes + (k // E) * B
    j = k % E
    if QTYPE == 0:  # Q8_0: d, int8 q[32]
        q = tl.load(w_ptr + base + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _half(h_ptr, base, mask)
    elif QTYPE <= 2:  # Q4_0: d, q[16]; Q4_1: d, m, q[16]
        qs = 2 if QTYPE == 1 else 4
        q = (_byte(w_ptr, base + qs + j % 16, mask) >> ((j // 16) * 4)) & 15
        if QTYPE == 1:
            w = _half(h_ptr, base, mask) * (q - 8).to(tl.float32)
        else:
            w = _half(h_ptr, base, mask) * q.to(tl.float32) + _half(h_ptr, base + 2, mask)
    elif QTYPE <= 4:  # Q5_0: d, qh u32, q[16]; Q5_1: d, m, qh, q[16]
        qh = 2 if QTYPE == 3 else 4
        high = (_byte(w_ptr, base + qh + j // 8, mask) >> (j % 8)) & 1
        q = ((_byte(w_ptr, base + qh + 4 + j % 16, mask) >> ((j // 16) * 4)) & 15) | (high << 4)
        if QTYPE == 3:
            w = _half(h_ptr, base, mask) * (q - 16).to(tl.float32)
        else:
            w = _half(h_ptr, base, mask) * q.to(tl.float32) + _half(h_ptr, base + 2, mask)
    elif QTYPE <= 6:  # Q4_K: d, dmin, scales[12], q[128]; Q5_K: and qh[32] before q
        s = j // 32
        i = j % 32
        sc, mn = _k_scale_min(w_ptr, base + 4, s, mask)
        qs = 16 if QTYPE == 5 else 48
        q = (_byte(w_ptr, base + qs + (s // 2) * 32 + i, mask) >> ((s % 2) * 4)) & 15
        if QTYPE == 6:
            q = q | (((_byte(w_ptr, base + 16 + i, mask) >> s) & 1) << 4)
        d = _half(h_ptr, base, mask) * sc
        w = d * q.to(tl.float32) - _half(h_ptr, base + 2, mask) * mn
    else:  # Q6_K: ql[128], qh[64], int8 scales[16], d
        half = j // 128
        r = j % 128
        low = (_byte(w_ptr, base + half * 64 + r % 64, mask) >> ((r // 64) * 4)) & 15
        high = (_byte(w_ptr, base + 128 + half * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
        sc = tl.load(w_ptr + base + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _half(h_ptr, base + 208, mask) * sc
        w = d * ((low | (high << 4)) - 32).to(tl.float32)
    return w


@triton.jit
def _first_row(w_ptr, h_ptr, n0, row_bytes):
    """w_ptr and h_ptr moved to row n0 (64-bit: a large weight passes 2 GB)."""
    offset = n0.to(tl.int64) * row_bytes
    return w_ptr + offset, h_ptr + offset // 2


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, h_ptr, y_ptr, in_features, out_features, row_bytes,
    QTYPE: tl.constexpr, E: tl.constexpr, B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    t = tl.program_id(1).to(tl.int64)
    n_mask = n0 + n < out_features
    w_ptr, h_ptr = _first_row(w_ptr, h_ptr, n0, row_bytes)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xk = tl.load(x_ptr + t * in_features + k, mask=k_mask, other=0.0).to(tl.float32)
        w = _decode(w_ptr, h_ptr, n[:, None], k[None, :], n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE, E, B)
        # rounded to x's dtype first, as the reference rounds the dequantized weight
        acc += tl.sum(w.to(x_ptr.dtype.element_ty).to(tl.float32) * xk[None, :], axis=1)
    tl.store(y_ptr + t * out_features + n0 + n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, h_ptr, y_ptr, tokens, in_features, out_features, row_bytes,
    QTYPE: tl.constexpr, E: tl.constexpr, B: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    # Programs next to each other share an output tile, so its blocks are decoded
    # from L2 rather than HBM for all but the first token tile.
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n0 = tl.program_id(1) * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    m_mask = m < tokens
    n_mask = n0 + n < out_features
    w_ptr, h_ptr = _first_row(w_ptr, h_ptr, n0, row_bytes)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * in_features
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        a = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(COMPUTE)
        w = _decode(w_ptr, h_ptr, n[None, :], k[:, None], k_mask[:, None] & n_mask[None, :], row_bytes, QTYPE, E, B)
        acc += tl.dot(a, w.to(COMPUTE), input_precision=DOT_PRECISION)
    y = y_ptr + m.to(tl.int64)[:, None] * out_features + n0 + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quant_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """kernels/gguf_quant.py's quant_linear: x [..., in] @ dequantize(weight).T ->
    [..., out] in x's dtype, decoding the blocks in the K loop."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.in_features).contiguous()
    tokens = x2.shape[0]
    y = torch.empty((tokens, weight.out_features), dtype=x.dtype, device=x.device)
    if tokens == 0 or weight.out_features == 0:
        return y.reshape(*lead, weight.out_features)
    data = weight.data.contiguous()
    elems, size = BLOCK_FORMATS[weight.qtype]
    row_bytes = weight.in_features // elems * size
    halves = data.view(torch.float16)  # the same bytes, for the fp16 scale fields
    tiles = gguf_tiles(tokens, weight.qtype)
    code = QTYPE_CODES[weight.qtype]
    launch = launch_options(tiles)
    if tiles.gemv:
        grid = (triton.cdiv(weight.out_features, tiles.block_n), tokens)
        _gemv_kernel[grid](
            x2, data, halves, y, weight.in_features, weight.out_features, row_bytes,
            QTYPE=code, E=elems, B=size, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **launch,
        )  # fmt: skip
    else:
        compute = tl.float32 if INTERPRET or x.dtype == torch.float32 else TL_DTYPES[x.dtype]
        grid = (triton.cdiv(tokens, tiles.block_m), triton.cdiv(weight.out_features, tiles.block_n))
        _gemm_kernel[grid](
            x2, data, halves, y, tokens, weight.in_features, weight.out_features, row_bytes,
            QTYPE=code, E=elems, B=size, COMPUTE=compute, DOT_PRECISION="ieee" if compute == tl.float32 else None,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, **launch,
        )  # fmt: skip
    return y.reshape(*lead, weight.out_features)
