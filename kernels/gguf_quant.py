"""GGUF's quantized weight blocks, kept as the file has them, and the torch reference
that multiplies them: ``quant_linear(x, weight)`` = dequantize, then ``x @ W.T``.

A quantized matrix [out, in] is stored row by row, each row ``in / block_elems``
blocks of ``block_bytes`` bytes (ggml's layout: the blocks run along the input
features, so rows are independent and can be permuted, sliced or stacked as byte
rows). The reference decodes each block exactly as the gguf package's numpy
``gguf.quants.dequantize`` does, the same fp32 operations in the same order, so the
two agree bit for bit (tests/unit/test_gguf_quant.py); the C++ kernels
(kernels/csrc/quant_linear_cpu.cpp, kernels/quant_cpu_ops.py) take the same blocks.

Block formats (ggml-common.h; d, dmin, m are fp16):
    Q8_0  32 x:  d, int8 q[32]                        x = q * d
    Q4_0  32 x:  d, q[16] nibbles (lo: 0-15, hi: 16-31)  x = d * (q - 8)
    Q4_1  32 x:  d, m, q[16]                           x = d * q + m
    Q5_0  32 x:  d, qh u32 (bit j: x_j's 5th bit), q[16]  x = d * (q - 16)
    Q5_1  32 x:  d, m, qh, q[16]                       x = d * q + m
    Q4_K  256 x: d, dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32,
                 q[128] (each 32 bytes: lo nibbles one sub-block, hi the next)
                                                       x = (d * sc) * q - (dmin * mn)
    Q5_K  256 x: Q4_K's, and qh[32] (bit i: sub-block i's 5th bits)
    Q6_K  256 x: ql[128], qh[64], int8 scales[16] (one per 16 x), d
                                                       x = (d * sc) * (q - 32)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

QK_K = 256
# type name -> (elements per block, bytes per block); the names are gguf's GGMLQuantizationType's.
BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] in GGUF blocks: ``data`` uint8
    [out_features, in_features / block_elems * block_bytes], the file's bytes."""

    qtype: str
    out_features: int
    in_features: int
    data: Tensor

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_FORMATS:
            raise ValueError(f"GGUF tensor type {self.qtype} is not served (served: {', '.join(BLOCK_FORMATS)})")
        elems, size = BLOCK_FORMATS[self.qtype]
        if self.in_features % elems:
            raise ValueError(f"{self.qtype}: in_features {self.in_features} is not a multiple of {elems}")
        expected = (self.out_features, self.in_features // elems * size)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            got = f"{self.data.dtype} {tuple(self.data.shape)}"
            raise ValueError(f"{self.qtype} blocks: {got}, expected uint8 {expected}")

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def rows(self, index: Tensor) -> QuantizedWeight:
        """The rows `index` (a permutation or a slice of output features)."""
        return QuantizedWeight(self.qtype, int(index.numel()), self.in_features, self.data[index].contiguous())

    def to(self, device: torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.qtype, self.out_features, self.in_features, self.data.to(device))

    def dequantize(self) -> Tensor:
        """fp32 [out_features, in_features]."""
        blocks = self.data.reshape(-1, BLOCK_FORMATS[self.qtype][1])
        return _DEQUANTIZE[self.qtype](blocks).reshape(self.out_features, self.in_features)


def stack(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The parts' rows one after another (q, k, v; gate, up) as one weight, or None
    where their formats differ (a Q4_K_M file keeps some tensors in Q6_K)."""
    first = parts[0]
    if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
        return None
    if len(parts) == 1:  # no copy: a tied LM head shares its embedding's blocks
        return first
    data = torch.cat([p.data for p in parts])
    return QuantizedWeight(first.qtype, sum(p.out_features for p in parts), first.in_features, data)


def quant_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype (the oracle)."""
    return F.linear(x, weight.dequantize().to(x.dtype))


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, K] (K a multiple of 32) -> (int8 quants [T, K], fp32 scales [T, K / 32]): per
    32-block d = amax / 127, q = round(x * (127 / amax)) to nearest even (0 where amax
    is 0), in fp32 operations the C++ kernel (kernels/csrc/quant_int8_cpu.cpp) repeats
    one for one, so both get the same quants and scales."""
    blocks = x.float().reshape(len(x), -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    # a division, as the kernel's 127.0f / amax (torch's `127.0 / amax` multiplies by a reciprocal: two roundings)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(blocks * inverse).to(torch.int8)
    return q.reshape(x.shape), (amax / 127.0).reshape(len(x), -1)


def quant_linear_int8(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in] with x quantized per 32-block (quantize_activations) @ dequantize(weight).T
    -> [T, out] in x's dtype: llama.cpp's int8-activation product, the oracle of
    --quant-activations int8. The products are summed in float64 (every term is exact
    there: an int8 times an fp32 scale, times an fp32 weight), so what the kernel adds
    to this is only its fp32 rounding of the scale products and the sums over blocks."""
    q, d = quantize_activations(x)
    x_hat = q.double().reshape(len(x), -1, 32) * d.double().unsqueeze(-1)
    return (x_hat.reshape(x.shape) @ weight.dequantize().double().T).to(x.dtype)


def _f16(b: Tensor) -> Tensor:
    """Little-endian fp16 bytes [n, 2] -> fp32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[n, g, 16 or 32] bytes -> [n, g, 2, ...]: low nibbles, then high nibbles."""
    return torch.stack([qs & 0x0F, qs >> 4], dim=-2)


def _bits(bytes_: Tensor, count: int) -> Tensor:
    """[n, m] bytes -> [n, count, m]: bit i of every byte."""
    shifts = torch.arange(count, dtype=torch.uint8, device=bytes_.device).view(1, count, 1)
    return (bytes_.unsqueeze(1) >> shifts) & 1


def _q8_0(b: Tensor) -> Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 2:]).reshape(len(b), 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_1(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 4:]).reshape(len(b), 32).float()
    return (_f16(b[:, :2]) * q) + _f16(b[:, 2:4])


def _q5_high(qh: Tensor) -> Tensor:
    """Q5_0/Q5_1's u32 of 5th bits [n, 4] -> [n, 32] (bit j for x_j)."""
    return _bits(qh, 8).transpose(1, 2).reshape(len(qh), 32)


def _q5_0(b: Tensor) -> Tensor:
    q = _nibbles(b[:, 6:]).reshape(len(b), 32) | (_q5_high(b[:, 2:6]) << 4)
    return _f16(b[:, :2]) * (q.to(torch.int8) - 16).float()


def _q5_1(b: Tensor) -> Tensor:
    q = (_nibbles(b[:, 8:]).reshape(len(b), 32) | (_q5_high(b[:, 4:8]) << 4)).float()
    return (_f16(b[:, :2]) * q) + _f16(b[:, 2:4])


def k_scale_min(scales: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 scale bytes [n, 12] -> (scales [n, 8], mins [n, 8]), 6 bits each."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_affine(b: Tensor, q: Tensor) -> Tensor:
    """(d * sc) * q - (dmin * mn) per sub-block of 32, q [n, 8, 32]."""
    n = len(b)
    sc, mn = k_scale_min(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b[:, 2:4]) * mn.float()).reshape(n, 8, 1)
    return (d * q.float() - dm).reshape(n, QK_K)


def _q4_k(b: Tensor) -> Tensor:
    return _k_affine(b, _nibbles(b[:, 16:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32))


def _q5_k(b: Tensor) -> Tensor:
    low = _nibbles(b[:, 48:].reshape(len(b), 4, 32)).reshape(len(b), 8, 32)
    return _k_affine(b, low | (_bits(b[:, 16:48], 8) << 4))


def _q6_k(b: Tensor) -> Tensor:
    n = len(b)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    low = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (d * q).reshape(n, QK_K)


_DEQUANTIZE = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
