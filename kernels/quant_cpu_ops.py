"""The C++ CPU kernels over GGUF blocks (kernels/csrc/quant_linear_cpu.cpp), with
kernels/gguf_quant.py's reference signature: quant_linear(x, weight)."""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_build
from kernels.gguf_quant import QuantizedWeight

# The formats the kernel decodes; the others run the reference.
CPU_FORMATS: tuple[str, ...] = ()
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


def takes(weight: QuantizedWeight) -> bool:
    """Whether the kernel multiplies this weight here (a format it decodes, on the CPU)."""
    return weight.qtype in CPU_FORMATS and weight.data.device.type == "cpu" and cpu_build.load()


def quant_linear(x: Tensor, weight: QuantizedWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype: fp32 products of x
    and the decoded weights, summed in fp32, rounded once to x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y: Tensor = torch.ops.pagedserve_cpu.quant_linear(x, weight.data, weight.qtype, weight.out_features)
    return y
