"""The C++ CPU kernels over GGUF blocks, with kernels/gguf_quant.py's reference
signatures: quant_linear(x, weight) (fp32 activations, kernels/csrc/quant_linear_cpu.cpp)
and quant_linear_int8(x, weight) (int8 activations, kernels/csrc/quant_int8_cpu.cpp)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from kernels import cpu_build
from kernels.gguf_quant import QuantizedWeight
from kernels.gguf_quant import quant_linear as reference_quant_linear
from kernels.gguf_quant import quant_linear_int8 as reference_quant_linear_int8

# The formats the kernel decodes (every one kernels/gguf_quant.py serves).
CPU_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel multiplies this weight here (a format it decodes, on the CPU)."""
    return weight.qtype in CPU_FORMATS and weight.data.device.type == "cpu" and cpu_build.load()


def quant_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype: fp32 products of x
    and the decoded weights, summed in fp32, rounded once to x's dtype."""
    return _call(torch.ops.pagedserve_cpu.quant_linear, reference_quant_linear, x, weight)


def quant_linear_int8(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in], quantized to int8 per 32-block, @ dequantize(weight).T -> [T, out] in
    x's dtype: integer dot products per block, scaled and summed in fp32."""
    return _call(torch.ops.pagedserve_cpu.quant_linear_int8, reference_quant_linear_int8, x, weight)


def _call(
    op: Callable[..., Tensor],
    reference: Callable[[Tensor, QuantizedWeight], Tensor],
    x: Tensor,
    weight: QuantizedWeight,
) -> Tensor:
    """The op where it takes x's dtype (fp32, bf16; rows made contiguous), else the reference."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return reference(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return op(x, weight.data, weight.qtype, weight.out_features)
