"""Each safetensors format's packing, undone into kernels/wquant.py's layouts at load.
The quantized integers and scales are kept as they are (a 4-bit weight stays 4 bits);
only their order changes. Written from each format's documented layout:

AWQ (GEMM version; AutoAWQ's WQLinear_GEMM): qweight int32 [in, out / 8], packed
    along the output: the word for outputs 8j..8j+7 holds output 8j + AWQ_ORDER[p]
    in bits 4p..4p+3; qzeros int32 [groups, out / 8], packed the same way; scales
    [groups, out]. W = (q - z) * s.
GPTQ (AutoGPTQ / GPTQModel): qweight int32 [in / 8, out], packed along the input
    (word k holds inputs 8k..8k+7, input 8k + p in bits 4p); qzeros int32
    [groups, out / 8] packed along the output in plain order, storing z - 1 in the
    original ("gptq", v1) checkpoint format and z in "gptq_v2"; scales [groups, out];
    g_idx int32 [in]: the group of each input (act-order permutes it).
compressed-tensors pack-quantized: weight_packed int32 [out, in / 8], input 8k + p
    in bits 4p of word k, stored as q + 8 (q signed, -8..7); weight_scale
    [out, groups]; weight_zero_point (asymmetric only) int32 [out / 8, groups]
    packed the same way along the output; weight_g_idx optional. W = (q - z) * s:
    in unsigned terms (q + 8) - (z + 8), so the zero point kept is z + 8.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from kernels.wquant import Int4Weight, ScaledWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble p of a word holds output 8j + AWQ_ORDER[p]


def _nibbles(words: Tensor) -> Tensor:
    """int32 [..., n] -> uint8 [..., n, 8]: nibble p (bits 4p..4p+3) of each word."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def pack_rows(q: Tensor) -> Tensor:
    """uint8 [out, in] 4-bit values -> uint8 [out, in / 2], low nibble the even input."""
    pairs = q.reshape(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()


def in_group_order(weight: Int4Weight) -> tuple[Int4Weight, Tensor] | None:
    """An act-order weight (g_idx) with its inputs reordered so that each group is one run
    of group_size inputs, and that order: x[:, order] @ W'.T is x @ W.T, the same products
    summed in another order. For kernels that read groups as runs (kernels/wquant_cpu.py).
    None without g_idx, or where a group does not hold exactly group_size inputs."""
    if weight.g_idx is None:
        return None
    group = weight.g_idx.long()
    sizes = torch.bincount(group, minlength=weight.scale.shape[1])
    if len(sizes) != weight.scale.shape[1] or not bool((sizes == weight.group_size).all()):
        return None
    order = torch.argsort(group, stable=True)
    return replace(weight, packed=pack_rows(weight.values()[:, order]), g_idx=None), order


def _along_output(words: Tensor, order: tuple[int, ...] = tuple(range(8))) -> Tensor:
    """int32 [rows, out / 8] packed along the output -> uint8 [rows, out]."""
    nib = _nibbles(words)
    inverse = [order.index(c) for c in range(8)]  # the nibble holding column c of the eight
    return nib[..., inverse].reshape(words.shape[0], -1)


def awq(qweight: Tensor, qzeros: Tensor, scales: Tensor, group_size: int) -> Int4Weight:
    q = _along_output(qweight, AWQ_ORDER).t()  # [out, in]
    zero = _along_output(qzeros, AWQ_ORDER).t().contiguous()
    return Int4Weight("awq", pack_rows(q), scales.t().contiguous(), zero, group_size)


def gptq(
    qweight: Tensor, qzeros: Tensor, scales: Tensor, g_idx: Tensor | None, group_size: int, zero_offset: int
) -> Int4Weight:
    """zero_offset: 1 for the v1 checkpoint format (z - 1 stored), 0 for v2. A g_idx
    equal to i // group_size is dropped (the plain order)."""
    q = _nibbles(qweight).permute(1, 0, 2).reshape(qweight.shape[1], -1)  # [out, in]
    zero = ((_along_output(qzeros).int() + zero_offset) & 0xF).to(torch.uint8).t().contiguous()
    if g_idx is not None:
        plain = torch.arange(q.shape[1], device=g_idx.device) // group_size
        g_idx = None if torch.equal(g_idx.long(), plain) else g_idx.to(torch.int32)
    return Int4Weight("gptq", pack_rows(q), scales.t().contiguous(), zero, group_size, g_idx)


def pack_quantized(
    packed: Tensor, scale: Tensor, zero_point: Tensor | None, g_idx: Tensor | None, group_size: int, out: int
) -> Int4Weight:
    """compressed-tensors' pack-quantized, 4 bits; zero_point None: symmetric."""
    q = _nibbles(packed).reshape(packed.shape[0], -1)
    if zero_point is None:
        zero = torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device)
    else:  # packed along the output, signed values stored + 8 like the weights
        zero = _nibbles(zero_point.t().contiguous()).reshape(zero_point.shape[1], -1)[:, :out].t().contiguous()
    return Int4Weight("pack-quantized", pack_rows(q), scale, zero, group_size,
                      None if g_idx is None else g_idx.to(torch.int32))  # fmt: skip


def scaled(fmt: str, weight: Tensor, scale: Tensor, block: tuple[int, int] | None) -> ScaledWeight:
    """An int8/fp8 weight [out, in] with a per-tensor ([] or [1]), per-channel
    ([out] or [out, 1]) or, given `block`, per-tile scale."""
    out, inp = weight.shape
    scale = scale.float()
    if block is not None:
        return ScaledWeight(fmt, weight, scale.reshape(-(-out // block[0]), -(-inp // block[1])), *block)
    if scale.numel() == 1:
        return ScaledWeight(fmt, weight, scale.reshape(1, 1), out, inp)
    if scale.numel() == out:
        return ScaledWeight(fmt, weight, scale.reshape(out, 1), 1, inp)
    raise ValueError(f"{fmt}: weight_scale {tuple(scale.shape)} is not per tensor or per channel of [{out}, {inp}]")
