"""Activation quantization with 8-bit weights (W8A8), the torch references of the GPU
paths that quantize activations (kernels/triton/wquant.py's w8a8_linear and
fp8_linear): each token's row gets its own scale (dynamic per-token, as
compressed-tensors' `strategy: token, dynamic: true` and FP8's dynamic activation
scheme ask), the integer products are summed exactly in int32 (int8) or the fp8
products in fp32, and the sum is scaled by the token's and the output row's scales.

The worker's own path does not use them: it multiplies the dequantized weights
(W8A16, kernels/wquant.py), token-exact with transformers on the dequantized
weights; these are what the W8A8 kernels are measured and checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels.wquant import ScaledWeight

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_rows_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, in] -> (int8 [T, in], fp32 scale [T, 1]): round(x / s), s = amax(|row|) / 127."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
    return (x.float() / scale).round().clamp(-128, 127).to(torch.int8), scale


def quantize_rows_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, in] -> (float8_e4m3fn [T, in], fp32 scale [T, 1]), s = amax(|row|) / 448."""
    scale = (x.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def w8a8_linear(x: Tensor, weight: ScaledWeight) -> Tensor:
    """x [T, in] @ W.T with x quantized per token: int8 weights sum in int32 (exact),
    fp8 weights in fp32; -> [T, out] in x's dtype. Weights scaled per tensor or channel."""
    if weight.data.dtype == torch.int8:
        xq, sx = quantize_rows_int8(x)
        acc = (xq.long() @ weight.data.long().t()).float()  # exact: |sum| < 2^31 for in < 2^17
    else:
        xq, sx = quantize_rows_fp8(x)
        acc = xq.float() @ weight.data.float().t()
    return (acc * sx * weight.channel_scales().unsqueeze(0)).to(x.dtype)
