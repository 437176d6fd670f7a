"""The quantized cache's arithmetic inside the kernels (FP8 e4m3 / INT8 with
per-token-per-head scales, the math of kernels/quant.py): the quantizing write
(quantize_rows, round_e4m3; to_cache for an unquantized cache) and the
dequantizing read (from_cache), and the scale tensors a launch passes.

FP8 rounding is done in fp32 arithmetic (round_e4m3), not by the cast: the
interpreter's fp32 -> fp8 cast mis-rounds (e.g. 126.6 -> 64), and the explicit
round-to-nearest-even gives the bits torch's cast gives, everywhere."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from kernels.quant import KVScales


@triton.jit
def to_cache(x, cache_ptr):
    # The write of an unquantized cache: a plain cast to the cache dtype. The
    # quantized caches go through quantize_rows below.
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def round_e4m3(y):
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
def quantize_rows(x, QUANT: tl.constexpr):
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
        q = round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
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


@triton.jit
def from_cache(x, scale_ptr, zero_ptr, scale_off, mask, COMPUTE: tl.constexpr, QUANT: tl.constexpr):
    # The dequantizing read (the mirror of quantize_rows): x is a [BLOCK_N, BLOCK_D]
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


def scale_pointers(scales: KVScales) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The kernels' four scale pointer arguments: FP8 has no zero points, and their
    slots get the scales (never read). All four share one layout."""
    k_zero = scales.k_scale if scales.k_zero is None else scales.k_zero
    v_zero = scales.v_scale if scales.v_zero is None else scales.v_zero
    pointers = (scales.k_scale, scales.v_scale, k_zero, v_zero)
    assert len({t.stride() for t in pointers}) == 1, [t.stride() for t in pointers]
    return pointers
