"""The C++ CPU kernels over GGUF blocks, with kernels/gguf_quant.py's reference
signatures: quant_linear(x, weight) (fp32 activations, kernels/csrc/quant_linear_cpu.cpp)
and quant_linear_int8(x, weight) (int8 activations, kernels/csrc/quant_int8_cpu.cpp),
which also multiplies a weight packed for it at load (pack_int8: Int8Panels)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_build
from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from kernels.gguf_quant import quant_linear as reference_quant_linear
from kernels.gguf_quant import quant_linear_int8 as reference_quant_linear_int8

# The formats the kernel decodes (every one kernels/gguf_quant.py serves).
CPU_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel multiplies this weight here (a format it decodes, on the CPU)."""
    return weight.qtype in CPU_FORMATS and weight.data.device.type == "cpu" and cpu_build.load()


@dataclass(frozen=True)
class Int8Panels:
    """A GGUF weight packed for the int8 panel GEMM (kernels/csrc/quant_int8_panel.h), in
    the file's bytes, permuted: each full group of `lanes` rows is, block by block, the
    rows' fp16 scales (Q4_1, Q5_1: then their m; Q4_K, Q5_K: d then dmin), then the rest
    of their blocks as 4-byte lanes, lane n of vector v holding row n's bytes 4v..4v+3 of
    the rest (quants; Q5's high bits, the K-quants' scales first; Q6_K's d ends its file blocks
    and opens its panel blocks). The rows after the last
    full group stay as the file has them. `qtype` names the layout, as
    quant_linear_int8 takes it."""

    format: str
    lanes: int
    out_features: int
    in_features: int
    data: Tensor

    @property
    def qtype(self) -> str:
        return f"{self.format}x{self.lanes}"

    def unpacked(self) -> QuantizedWeight:
        """The weight as the file has it (this layout's definition, the tests' oracle)."""
        lanes, (elems, size) = self.lanes, BLOCK_FORMATS[self.format]
        full, blocks = self.out_features // lanes * lanes, self.in_features // elems
        scale_bytes = 4 if self.format in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 2
        groups = self.data[:full].reshape(full // lanes, blocks, lanes * size)
        scales = groups[..., : scale_bytes * lanes].reshape(-1, blocks, scale_bytes // 2, lanes, 2)
        quants = groups[..., scale_bytes * lanes :].reshape(-1, blocks, (size - scale_bytes) // 4, lanes, 4)
        opening, rest = scales.permute(0, 3, 1, 2, 4).flatten(3), quants.permute(0, 3, 1, 2, 4).flatten(3)
        rows = torch.cat([rest, opening] if self.format == "Q6_K" else [opening, rest], dim=-1)  # Q6_K's d ends it
        data = torch.cat([rows.reshape(full, -1), self.data[full:]])
        return QuantizedWeight(self.format, self.out_features, self.in_features, data)

    def dequantize(self) -> Tensor:
        return self.unpacked().dequantize()


def pack_int8(weight: QuantizedWeight) -> QuantizedWeight | Int8Panels:
    """The weight packed for quant_linear_int8 where its panel GEMM takes the format in
    this build (every format, with AVX2; bench/results/int8_panel.md:
    what it gains), else the weight as it is."""
    if not takes(weight):
        return weight
    lanes = int(torch.ops.pagedserve_cpu.int8_pack_lanes(weight.qtype))
    if lanes == 0:
        return weight
    data = torch.ops.pagedserve_cpu.pack_int8(weight.data, weight.qtype)
    return Int8Panels(weight.qtype, lanes, weight.out_features, weight.in_features, data)


def quant_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype: fp32 products of x
    and the decoded weights, summed in fp32, rounded once to x's dtype."""
    return _call(torch.ops.pagedserve_cpu.quant_linear, reference_quant_linear, x, weight)


def quant_linear_int8(x: Tensor, weight: QuantizedWeight | Int8Panels) -> Tensor:
    """x [T, in], quantized to int8 per 32-block, @ dequantize(weight).T -> [T, out] in
    x's dtype: integer dot products per block, scaled and summed in fp32."""
    return _call(torch.ops.pagedserve_cpu.quant_linear_int8, reference_quant_linear_int8, x, weight)


def _call(
    op: Callable[..., Tensor],
    reference: Callable[[Tensor, QuantizedWeight], Tensor],
    x: Tensor,
    weight: QuantizedWeight | Int8Panels,
) -> Tensor:
    """The op where it takes x's dtype (fp32, bf16; rows made contiguous), else the reference."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return reference(x, weight.unpacked() if isinstance(weight, Int8Panels) else weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return op(x, weight.data, weight.qtype, weight.out_features)
