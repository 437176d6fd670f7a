"""Quantized KV cache: the quantize / dequantize math, as pure torch functions.

The reference ops (kernels/reference.py) call these; the Triton kernels
(kernels/triton/) do the same fp32 operations in the same order, so that
both write bit-identical caches.

Granularity: one scale (and, for INT8, one zero point) per *token per KV head*,
computed from that token's ``head_dim`` values when the token is written. The
scales live beside the block, shaped like the cache minus ``head_dim``:

    k_cache, v_cache  [layers, blocks, kv_heads, block_size, head_dim]  fp8 / int8
    k_scale, v_scale  [layers, blocks, kv_heads, block_size]            fp32
    k_zero,  v_zero   [layers, blocks, kv_heads, block_size]            int8 (INT8 only)

Why per token: a block is filled token by token across many steps (decode) and
by chunks of any size (chunked prefill, prefix-cache tails). A per-block scale
would have to grow when a later token raises the block's absmax, re-quantizing
the tokens already there (a read-modify-write of the whole block on every step,
and a result that depends on the order of the writes). A per-token scale is
written with its token and never changes, so writing a block one token at a time
gives exactly the cache that one write of the whole block gives, and
copy-on-write copies values and scales as plain bytes. Its cost is the scale
bytes: 4 per token per head for FP8, 5 for INT8 (fp32 scale + int8 zero point);
with head_dim 64 that is 6.25% / 7.8% on top of the 8-bit values, so the pool is
~53% / ~54% of an FP16 pool (the worker's Info reports the exact figures).

FP8 (e4m3, ``torch.float8_e4m3fn``, max 448), symmetric:
    s = amax / 448;  q = e4m3(clamp(x / s, -448, 448))  (round to nearest even);
    x' = q * s.
    Bound: |x' - x| <= 2^-4 |x| + 2^-10 s, i.e. <= amax / 16 (3 mantissa bits
    give a relative half-ulp of 2^-4; below 2^-6 the subnormal step is 2^-9).

INT8, asymmetric with a zero point:
    lo = min(min(x), 0), hi = max(max(x), 0);  s = (hi - lo) / 255;
    z = clamp(-128 - round(lo / s), -128, 127);  q = clamp(round(x / s) + z, -128, 127);
    x' = (q - z) * s.   round(y) = floor(y + 0.5).
    Bound: |x' - x| <= s / 2 = (hi - lo) / 510 <= amax / 255 (the range holds 0,
    so 0 is exact and z is an integer in [-128, 127]).

A token whose values are all zero gets s = 0 and dequantizes to exact zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_LEVELS = 255.0
SCALE_DTYPE = torch.float32
ZERO_DTYPE = torch.int8

QUANTIZED_DTYPES = (FP8_DTYPE, torch.int8)
# Kernel code of each cache dtype (the QUANT constexpr of the Triton kernels).
QUANT_NONE, QUANT_FP8, QUANT_INT8 = 0, 1, 2

# Documented round-trip bounds, per element: |x' - x| <= rel * |x| + amax_frac * amax.
# (fp32 arithmetic adds at most a few ulps on top; the tests allow 1e-6 relative.)
ROUND_TRIP_BOUNDS = {
    FP8_DTYPE: dict(rel=2.0**-4, amax_frac=2.0**-10 / FP8_MAX),
    torch.int8: dict(rel=0.0, amax_frac=1.0 / INT8_LEVELS),
}


def quant_code(dtype: torch.dtype) -> int:
    if dtype == FP8_DTYPE:
        return QUANT_FP8
    if dtype == torch.int8:
        return QUANT_INT8
    return QUANT_NONE


def is_quantized(dtype: torch.dtype) -> bool:
    return quant_code(dtype) != QUANT_NONE


def has_zero_point(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def scale_bytes_per_token_head(dtype: torch.dtype) -> int:
    """Bytes of scale (+ zero point) stored per token per KV head, for K or for V."""
    if not is_quantized(dtype):
        return 0
    size = torch.empty((), dtype=SCALE_DTYPE).element_size()
    if has_zero_point(dtype):
        size += torch.empty((), dtype=ZERO_DTYPE).element_size()
    return size


def _round(y: torch.Tensor) -> torch.Tensor:
    return torch.floor(y + 0.5)


def _div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device. On CUDA, torch divides by a
    Python (CPU) scalar as x * (1 / divisor), which can be one ulp off the IEEE
    quotient (1/448 and 1/255 are not exact in fp32); a divisor tensor on x's device
    takes the IEEE division path, the one the Triton write kernel computes with
    tl.math.div_rn, so both write the same scale bits."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] float8_e4m3fn, scale [...] fp32)."""
    x = x.float()
    scale = _div(x.abs().amax(-1), FP8_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / safe[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (q [..., head_dim] int8, scale [...] fp32, zero [...] int8)."""
    x = x.float()
    lo = x.amin(-1).clamp(max=0.0)
    hi = x.amax(-1).clamp(min=0.0)
    scale = _div(hi - lo, INT8_LEVELS)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (-128.0 - _round(lo / safe)).clamp(-128.0, 127.0)
    q = (_round(x / safe[..., None]) + zero[..., None]).clamp(-128.0, 127.0)
    return q.to(torch.int8), scale, zero.to(ZERO_DTYPE)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, scale, zero or None) for a quantized cache dtype."""
    if dtype == FP8_DTYPE:
        q, scale = quantize_fp8(x)
        return q, scale, None
    if dtype == torch.int8:
        return quantize_int8(x)
    raise ValueError(f"{dtype} is not a quantized KV dtype")


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """q [..., head_dim] with scale (and zero) [...] -> fp32 [..., head_dim]."""
    values = q.float()
    if zero is not None:
        values = values - zero.float()[..., None]
    return values * scale[..., None]


@dataclass(frozen=True, slots=True)
class KVScales:
    """The scales (and, for INT8, zero points) of a quantized K/V cache, shaped
    like the cache minus head_dim: all layers ([layers, ids, kv_heads, tokens]) in
    a cache pool, one layer (``scales[layer]``) in an op's call. The ops take one
    of these or None (an unquantized cache)."""

    k_scale: Tensor
    v_scale: Tensor
    k_zero: Tensor | None = None  # INT8 only
    v_zero: Tensor | None = None

    @classmethod
    def zeros(cls, values_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> KVScales | None:
        """Zeroed scales for a cache of `dtype` whose values are `values_shape`; None unquantized."""
        if not is_quantized(dtype):
            return None
        shape = values_shape[:-1]
        k_scale, v_scale = (torch.zeros(shape, dtype=SCALE_DTYPE, device=device) for _ in range(2))
        if not has_zero_point(dtype):
            return cls(k_scale, v_scale)
        k_zero, v_zero = (torch.zeros(shape, dtype=ZERO_DTYPE, device=device) for _ in range(2))
        return cls(k_scale, v_scale, k_zero, v_zero)

    def __getitem__(self, index: int) -> KVScales:
        """One layer's (or one id's) scales."""
        k_zero = None if self.k_zero is None else self.k_zero[index]
        v_zero = None if self.v_zero is None else self.v_zero[index]
        return KVScales(self.k_scale[index], self.v_scale[index], k_zero, v_zero)

    @property
    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors held: the scales, then the zero points if any."""
        return tuple(t for t in (self.k_scale, self.v_scale, self.k_zero, self.v_zero) if t is not None)

    @property
    def sides(self) -> tuple[tuple[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]:
        """((k_scale, k_zero), (v_scale, v_zero))."""
        return (self.k_scale, self.k_zero), (self.v_scale, self.v_zero)

    def check(self, k_cache: Tensor, v_cache: Tensor) -> None:
        """These are the scales of one layer of this cache: shaped like it minus
        head_dim, fp32, with int8 zero points exactly when the cache is INT8."""
        assert v_cache.dtype == k_cache.dtype, (k_cache.dtype, v_cache.dtype)
        assert self.k_scale.shape == self.v_scale.shape == k_cache.shape[:-1], (self.k_scale.shape, k_cache.shape)
        assert self.k_scale.dtype == self.v_scale.dtype == SCALE_DTYPE, self.k_scale.dtype
        if has_zero_point(k_cache.dtype):
            assert self.k_zero is not None and self.v_zero is not None, f"a {k_cache.dtype} cache needs zero points"
            assert self.k_zero.shape == self.v_zero.shape == self.k_scale.shape
            assert self.k_zero.dtype == self.v_zero.dtype == ZERO_DTYPE
        else:
            assert self.k_zero is None and self.v_zero is None, f"a {k_cache.dtype} cache has no zero points"


def checked_scales(k_cache: Tensor, v_cache: Tensor, scales: KVScales | None) -> KVScales | None:
    """`scales` for a quantized cache (checked; a quantized cache without them is
    refused), None for an unquantized one."""
    if not is_quantized(k_cache.dtype):
        return None
    assert scales is not None, f"a {k_cache.dtype} cache needs its scales"
    scales.check(k_cache, v_cache)
    return scales
