"""The C++ CPU kernel over the quantized safetensors weights
(kernels/csrc/wquant_cpu.cpp), with kernels/wquant.py's reference signature:
wquant_linear(x, weight) = x @ dequantize(weight).T, read from the stored bytes (no
dequantized copy, no repacked one: the kernel takes the loader's layouts as they are).

What it takes (`takes`): int8 and fp8 weights scaled per tensor, channel or tile, and
group-wise int4 whose groups are runs of inputs (AWQ; GPTQ without act-order, or
with a g_idx equal to the plain order, which the loader drops; pack-quantized), in
both cases with the input count and the block / group width multiples of 16, on the
CPU with the kernels built. Anything else stays on the reference (same values, slower).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import cpu_build
from kernels.wquant import Int4Weight, WQuantWeight
from kernels.wquant import wquant_linear as reference_wquant_linear

_CHUNK = 16  # inputs the kernel decodes at a time


def takes(weight: WQuantWeight) -> bool:
    """Whether the kernel multiplies this weight here."""
    parts: tuple[Tensor, ...]
    if isinstance(weight, Int4Weight):
        device, width, parts = weight.packed.device, weight.group_size, (weight.packed, weight.scale, weight.zero)
        runs = weight.g_idx is None and weight.scale.dtype in (torch.float32, torch.float16, torch.bfloat16)
    else:
        device, width, parts = weight.data.device, min(weight.block_in, weight.in_features), (weight.data, weight.scale)
        runs = weight.scale.dtype == torch.float32
    return (
        runs
        and device.type == "cpu"
        and all(p.is_contiguous() for p in parts)
        and weight.in_features % _CHUNK == 0
        and width % _CHUNK == 0
        and cpu_build.load()
    )


def wquant_linear(x: Tensor, weight: WQuantWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype: the kernel where it
    takes the weight (checked on every call: WQuantLinear checks once and calls
    `multiply`), else the reference."""
    return multiply(x, weight) if takes(weight) else reference_wquant_linear(x, weight)


def multiply(x: Tensor, weight: WQuantWeight) -> Tensor:
    """wquant_linear for a weight the kernel takes: fp32 products of x and the decoded
    weights (the reference's values bit for bit), summed in fp32, rounded once to x's
    dtype; x of another dtype than fp32 or bf16 goes to the reference."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        return reference_wquant_linear(x, weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    op = torch.ops.pagedserve_cpu.wquant_linear
    y: Tensor
    if isinstance(weight, Int4Weight):
        y = op(x, weight.packed, weight.scale, weight.zero, "int4", 1, weight.group_size)
    else:
        kind = "int8" if weight.data.dtype == torch.int8 else "fp8"
        y = op(x, weight.data.view(torch.uint8), weight.scale, None, kind, weight.block_out, weight.block_in)
    return y
