"""Small quantized safetensors weights in each layout the C++ kernel takes (INT4 with
fp16/bf16/fp32 scales and partial groups, INT8 per channel and per tensor, FP8 per
channel and in tiles): shared by tests/unit/test_wquant_cpu.py and test_work_pool.py."""

from __future__ import annotations

import torch

from kernels.wquant import Int4Weight, ScaledWeight
from kernels.wquant_formats import pack_rows


def int4(out: int, inp: int, group: int, scale_dtype: torch.dtype, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    groups = -(-inp // group)
    q = torch.randint(0, 16, (out, inp), generator=g, dtype=torch.uint8)
    scale = (torch.rand(out, groups, generator=g) * 0.02 + 0.005).to(scale_dtype)
    zero = torch.randint(0, 16, (out, groups), generator=g, dtype=torch.uint8)
    return Int4Weight("test", pack_rows(q), scale, zero, group)


def scaled(dtype: torch.dtype, out: int, inp: int, block: tuple[int, int], seed: int = 1) -> ScaledWeight:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        data = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    else:  # the range a checkpoint's scale maps its weights into, subnormals included
        data = (torch.randn(out, inp, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    bo, bi = min(block[0], out), min(block[1], inp)
    scale = torch.rand(-(-out // bo), -(-inp // bi), generator=g) * 0.01 + 0.001
    return ScaledWeight("test", data, scale, bo, bi)


WEIGHTS = {
    "int4-g32-fp16": lambda: int4(72, 160, 32, torch.float16),
    "int4-g64-bf16-partial-group": lambda: int4(37, 96, 64, torch.bfloat16),
    "int4-per-channel-fp32": lambda: int4(9, 48, 48, torch.float32),
    "int8-channel": lambda: scaled(torch.int8, 72, 160, (1, 10**6)),
    "int8-tensor": lambda: scaled(torch.int8, 33, 64, (10**6, 10**6)),
    "fp8-channel": lambda: scaled(torch.float8_e4m3fn, 72, 160, (1, 10**6)),
    "fp8-tile-128": lambda: scaled(torch.float8_e4m3fn, 200, 272, (128, 128)),
    "fp8-tile-32x64": lambda: scaled(torch.float8_e4m3fn, 70, 160, (32, 64)),
}
