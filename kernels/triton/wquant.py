"""Quantized-weight GEMMs in Triton, each the op of a torch reference (tested under
TRITON_INTERPRET=1, measured by bench/gpu_check.py):

* wquant_linear (kernels/wquant.py's): up to GEMV_MAX_TOKENS rows (a decode step),
  dequantize_gemv: one program per (GEMV_BLOCK_N outputs, token), the tile's decoded
  weights times the token's slice of x summed along K in fp32, as
  kernels/triton/gguf_gemm.py's GEMV (no 16-row MMA tile padded from one row, and
  512 programs for 4,096 outputs where the GEMM had 64: at one row the GEMM read an
  INT4 weight at ~25 GB/s on the H200 at 6660104). Below DEQUANTIZE_FROM_TOKENS rows,
  dequantize_in_the_loop. Each program owns a BLOCK_M x BLOCK_N output tile and walks
  the input in BLOCK_K steps: it loads the weight tile as stored (4-bit nibbles with
  their group's scale and zero point, or int8/fp8 values with their block's scale),
  dequantizes it in registers in fp32, rounds it to x's dtype (the reference's
  `dequantize().to(x.dtype)`) and feeds tl.dot, accumulating in fp32. The weight is
  read once per M tile at its stored size; at decode (M <= BLOCK_M) that is once.
  AWQ, GPTQ (act-order too: g_idx is read per input) and compressed-tensors' INT4
  share the one INT4 kernel after the load-time repack (kernels/wquant_formats.py).
  From DEQUANTIZE_FROM_TOKENS rows (a prefill) the reference itself runs: the weight
  dequantized once into x's dtype, then cuBLAS. The in-loop kernel decodes every
  weight tile again for each 16-row M tile: on an H200 (bench/results/wquant_gemm_gpu.md
  at 6660104) it ran at 4.4 TFLOP/s for INT4 and 12 for INT8 / FP8 W8A16 at 2,048
  rows, 0.01-0.02x bf16 cuBLAS, and no faster at 128 rows than at 2,048. 256 is
  vLLM's threshold for its AWQ kernel; where the two cross on a GPU is still to
  measure (bench/wquant_gemm.py prints both).
* w8a8_linear (kernels/wquant_act.py's): int8 weights times int8 per-token
  activations, int32 tl.dot, the two scales applied to the sum.
* fp8_linear (kernels/wquant_act.py's w8a8_linear for fp8 weights):
  torch._scaled_mm with per-token and per-channel scales where the GPU has FP8
  (compute capability 8.9+), the reference otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import wquant, wquant_act
from kernels.triton.common import INTERPRET
from kernels.wquant import Int4Weight, ScaledWeight, WQuantWeight

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
DEQUANTIZE_FROM_TOKENS = 256
GEMV_MAX_TOKENS = 4  # past it the GEMV would decode the weight once per token
GEMV_BLOCK_N, GEMV_BLOCK_K = 8, 128


@triton.jit
def _load_rows(ptr, rows, rk, R, K):
    """rows [B] x columns rk [BLOCK_K] of a row-major [R, K] matrix, 0 outside it."""
    return tl.load(ptr + rows[:, None] * K + rk[None, :], mask=(rows < R)[:, None] & (rk < K)[None, :], other=0)


@triton.jit
def _store_tile(y_ptr, y, rm, rn, M, N):
    tl.store(
        y_ptr + rm[:, None] * N + rn[None, :], y.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :]
    )


@triton.jit
def _int4_tile(packed_ptr, scale_ptr, zero_ptr, gidx_ptr, rn, rk, mask, K, groups, group_size, HAS_GIDX: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile of an Int4Weight, fp32: (q - zero) * scale of each input's group."""
    byte = tl.load(packed_ptr + rn[:, None] * (K // 2) + rk[None, :] // 2, mask=mask, other=0).to(tl.int32)
    q = (byte >> ((rk[None, :] % 2) * 4)) & 0xF
    if HAS_GIDX:
        g = tl.load(gidx_ptr + rk, mask=rk < K, other=0).to(tl.int32)
    else:
        g = rk // group_size
    at = rn[:, None] * groups + g[None, :]
    s = tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + at, mask=mask, other=0).to(tl.int32)
    return (q - z).to(tl.float32) * s


@triton.jit
def _scaled_tile(w_ptr, scale_ptr, rn, rk, mask, K, block_out, block_in, scale_cols, FP8: tl.constexpr):
    """The weight tile of a ScaledWeight, fp32: the value times its tile's scale."""
    q = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=mask, other=0)
    if FP8:  # fp8 bytes arrive as uint8 (a masked fp8 load has no `other` here) and are reinterpreted
        q = q.to(tl.float8e4nv, bitcast=True)
    at = (rn[:, None] // block_out) * scale_cols + rk[None, :] // block_in
    return q.to(tl.float32) * tl.load(scale_ptr + at, mask=mask, other=0.0)


@triton.jit
def _dequant_gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, gidx_ptr, y_ptr, M, N, K, scale_cols, block_out, block_in,
    INT4: tl.constexpr, HAS_GIDX: tl.constexpr, FP8: tl.constexpr, FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y = x @ W.T, W's tiles dequantized in registers (INT4: block_in is the group size)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = _load_rows(x_ptr, rm, rk, M, K)
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        if INT4:
            w = _int4_tile(w_ptr, scale_ptr, zero_ptr, gidx_ptr, rn, rk, mask, K, scale_cols, block_in, HAS_GIDX)
        else:
            w = _scaled_tile(w_ptr, scale_ptr, rn, rk, mask, K, block_out, block_in, scale_cols, FP8)
        if FP32:  # ieee: tl.dot's default rounds fp32 inputs to tf32 on a GPU (10 mantissa bits)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:  # the reference's weights: dequantized, then rounded to x's dtype
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
    _store_tile(y_ptr, acc, rm, rn, M, N)


@triton.jit
def _dequant_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, gidx_ptr, y_ptr, N, K, scale_cols, block_out, block_in,
    INT4: tl.constexpr, HAS_GIDX: tl.constexpr, FP8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """y[t] = W @ x[t] for token t = program_id(1), BLOCK_N outputs a program."""
    t = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        xk = tl.load(x_ptr + t * K + rk, mask=rk < K, other=0.0).to(tl.float32)
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        if INT4:
            w = _int4_tile(w_ptr, scale_ptr, zero_ptr, gidx_ptr, rn, rk, mask, K, scale_cols, block_in, HAS_GIDX)
        else:
            w = _scaled_tile(w_ptr, scale_ptr, rn, rk, mask, K, block_out, block_in, scale_cols, FP8)
        # rounded to x's dtype first, as the reference rounds the dequantized weight
        acc += tl.sum(w.to(x_ptr.dtype.element_ty).to(tl.float32) * xk[None, :], axis=1)
    tl.store(y_ptr + t * N + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < N)


@triton.jit
def _w8a8_kernel(
    xq_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        acc += tl.dot(_load_rows(xq_ptr, rm, rk, M, K), tl.trans(_load_rows(w_ptr, rn, rk, N, K)), out_dtype=tl.int32)
    sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=rn < N, other=0.0)
    _store_tile(y_ptr, acc.to(tl.float32) * sx[:, None] * sw[None, :], rm, rn, M, N)


def _grid(m: int, n: int) -> tuple[int, int]:
    return triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N)


def wquant_linear(x: Tensor, weight: WQuantWeight) -> Tensor:
    """kernels.wquant.wquant_linear: x [T, in] @ dequantize(weight).T in x's dtype; a
    decode's rows through the GEMV, a prefill's through the reference (dequantize once,
    then cuBLAS: the module's doc)."""
    if x.shape[0] >= DEQUANTIZE_FROM_TOKENS or not triton_decodes(weight, x.device):
        return wquant.wquant_linear(x, weight)
    if x.shape[0] <= GEMV_MAX_TOKENS:
        return dequantize_gemv(x, weight)
    return dequantize_in_the_loop(x, weight)


def triton_decodes(weight: WQuantWeight, device: torch.device) -> bool:
    """Whether the Triton kernels read this weight on `device`: every format but FP8 on a
    GPU below compute capability 8.9 (Triton has no fp8e4nv there: an A100 takes the
    reference, torch converting e4m3 in software)."""
    fp8 = isinstance(weight, ScaledWeight) and weight.data.dtype == torch.float8_e4m3fn
    return not (fp8 and device.type == "cuda" and not has_fp8_mm(device))


def _weight_args(weight: WQuantWeight) -> tuple[tuple[object, ...], dict[str, bool]]:
    """The kernels' weight arguments (w, scale, zero, g_idx, scale_cols, block_out, block_in;
    INT4: block_in is the group size) and flags."""
    if isinstance(weight, Int4Weight):
        gidx = weight.g_idx if weight.g_idx is not None else weight.zero  # unread without HAS_GIDX
        args = (weight.packed, weight.scale, weight.zero, gidx, weight.scale.shape[1], 1, weight.group_size)
        return args, {"INT4": True, "HAS_GIDX": weight.g_idx is not None, "FP8": False}
    fp8 = weight.data.dtype == torch.float8_e4m3fn
    data = weight.data.view(torch.uint8) if fp8 else weight.data
    args = (data, weight.scale, weight.scale, weight.scale, weight.scale.shape[1], weight.block_out, weight.block_in)
    return args, {"INT4": False, "HAS_GIDX": False, "FP8": fp8}


def dequantize_in_the_loop(x: Tensor, weight: WQuantWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T in x's dtype, each weight tile decoded in registers."""
    tokens, n, k = x.shape[0], weight.out_features, weight.in_features
    y = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    x = x.contiguous()
    fp32 = INTERPRET or x.dtype == torch.float32  # the interpreter's bf16 is raw bits (common.py)
    (w, scale, zero, gidx, *sizes), flags = _weight_args(weight)
    _dequant_gemm_kernel[_grid(tokens, n)](
        x, w, scale, zero, gidx, y, tokens, n, k, *sizes, **flags, FP32=fp32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y


def dequantize_gemv(x: Tensor, weight: WQuantWeight) -> Tensor:
    """As dequantize_in_the_loop, one program per (GEMV_BLOCK_N outputs, token)."""
    tokens, n, k = x.shape[0], weight.out_features, weight.in_features
    y = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    (w, scale, zero, gidx, *sizes), flags = _weight_args(weight)
    _dequant_gemv_kernel[(triton.cdiv(n, GEMV_BLOCK_N), tokens)](
        x.contiguous(), w, scale, zero, gidx, y, n, k, *sizes, **flags,
        BLOCK_N=GEMV_BLOCK_N, BLOCK_K=GEMV_BLOCK_K, num_warps=4, num_stages=2,
    )  # fmt: skip
    return y


def w8a8_linear(x: Tensor, weight: ScaledWeight) -> Tensor:
    """kernels.wquant_act.w8a8_linear for an int8 weight: int32 tl.dot."""
    if weight.data.dtype != torch.int8:
        raise ValueError(f"w8a8_linear takes int8 weights, not {weight.data.dtype} (fp8: fp8_linear)")
    tokens, n, k = x.shape[0], weight.out_features, weight.in_features
    y = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    xq, sx = wquant_act.quantize_rows_int8(x)
    _w8a8_kernel[_grid(tokens, n)](
        xq, sx, weight.data, weight.channel_scales(), y, tokens, n, k,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y


def has_fp8_mm(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 GEMM runs here: CUDA compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: Tensor, weight: ScaledWeight) -> Tensor:
    """x quantized to fp8 per token times an fp8 weight scaled per channel: torch._scaled_mm
    (fp32 sums, both scales applied to them) where the GPU has FP8 and the weight's sides
    are multiples of 16, else the reference."""
    if weight.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear takes float8_e4m3fn weights, not {weight.data.dtype}")
    if not has_fp8_mm(x.device) or x.shape[0] == 0 or weight.in_features % 16 or weight.out_features % 16:
        return wquant_act.w8a8_linear(x, weight)  # _scaled_mm takes only multiples of 16
    xq, sx = wquant_act.quantize_rows_fp8(x)
    scale_w = weight.channel_scales().unsqueeze(0)  # [1, out]: row-wise scaling
    out: Tensor = torch._scaled_mm(xq, weight.data.t(), scale_a=sx, scale_b=scale_w, out_dtype=x.dtype)
    return out
