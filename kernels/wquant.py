"""Quantized safetensors weights (FP8, INT8, group-wise INT4) kept resident as
their bytes, and the torch reference that multiplies them: ``wquant_linear(x, w)``
= dequantize, then ``x @ W.T`` (the oracle of the Triton kernels,
kernels/triton/wquant.py, and the CPU path).

Two layouts cover every served format once each format's own packing has been
undone at load (kernels/wquant_formats.py):

    ScaledWeight   W = data * scale, data [out, in] int8 or float8_e4m3fn, one
                   fp32 scale per block of (block_out x block_in) weights: the
                   whole matrix (per-tensor), a row (per-channel) or a tile
                   (FineGrainedFP8's 128 x 128).
    Int4Weight     W[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)], q 4 bits
                   packed two to a byte along the input (low nibble: the even
                   input), g(i) = i // group_size, or g_idx[i] where the format
                   reorders its groups (GPTQ's act-order).

The dequantization is one fp32 multiply of exact integers (or exact fp8 values),
so every implementation of it that computes in fp32 gives these bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

# Every float8_e4m3fn byte's value (NaN at 0x7f and 0xff, as the format has it).
_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


@dataclass(frozen=True)
class ScaledWeight:
    """data [out, in] (int8 | float8_e4m3fn) times fp32 `scale` [ceil(out / block_out),
    ceil(in / block_in)]. `fmt` names the checkpoint's format (the weight_format)."""

    fmt: str
    data: Tensor
    scale: Tensor
    block_out: int
    block_in: int

    def __post_init__(self) -> None:
        if self.data.dtype not in (torch.int8, torch.float8_e4m3fn) or self.data.dim() != 2:
            raise ValueError(f"{self.fmt}: weight {self.data.dtype} {tuple(self.data.shape)} is not int8/fp8 [out, in]")
        out, inp = self.data.shape
        expected = (-(-out // self.block_out), -(-inp // self.block_in))
        if tuple(self.scale.shape) != expected:
            raise ValueError(f"{self.fmt}: scale shape {tuple(self.scale.shape)}, expected {expected}")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.data.shape[1])

    @property
    def per_channel(self) -> bool:
        """One scale per output row (what the int8/fp8 GEMM kernels take)."""
        return self.block_out == 1 and self.block_in >= self.in_features

    def channel_scales(self) -> Tensor:
        """fp32 [out]: the per-row scale of a per-tensor or per-channel weight."""
        if self.block_in < self.in_features:
            raise ValueError(f"{self.fmt}: a {self.block_out}x{self.block_in} block scale is not per channel")
        return self.scale[:, 0].repeat_interleave(self.block_out)[: self.out_features].contiguous()

    def to(self, device: torch.device) -> ScaledWeight:
        return replace(self, data=self.data.to(device), scale=self.scale.to(device))

    def dequantize(self) -> Tensor:
        """fp32 [out, in]."""
        if self.data.dtype == torch.float8_e4m3fn and self.data.device.type == "cpu":
            # a table lookup: 3x torch's fp8 cast on the CPU, same bits. Elsewhere the cast:
            # no host-to-device copy, which a CUDA graph's capture (a prefill-sized
            # decode batch takes this path, kernels/triton/wquant.py) cannot hold.
            values = torch.take(_FP8_VALUES, self.data.view(torch.uint8).long())
        else:
            values = self.data.float()
        if self.block_in >= self.in_features:  # per tensor or channel: a broadcast, no expanded copy
            return values * self.scale.repeat_interleave(self.block_out, 0)[: self.out_features]
        scale = self.scale.repeat_interleave(self.block_out, 0)[: self.out_features]
        return values * scale.repeat_interleave(self.block_in, 1)[:, : self.in_features]


@dataclass(frozen=True)
class Int4Weight:
    """packed uint8 [out, in / 2]; scale [out, groups] (the checkpoint's float dtype);
    zero uint8 [out, groups] in 0..15 (8 where the format is symmetric); g_idx int
    [in] or None (then input i is in group i // group_size)."""

    fmt: str
    packed: Tensor
    scale: Tensor
    zero: Tensor
    group_size: int
    g_idx: Tensor | None = None

    def __post_init__(self) -> None:
        out, half = self.packed.shape
        groups = -(-half * 2 // self.group_size)
        if self.packed.dtype != torch.uint8 or tuple(self.scale.shape) != (out, groups):
            got = f"packed {self.packed.dtype} {tuple(self.packed.shape)}, scale {tuple(self.scale.shape)}"
            raise ValueError(f"{self.fmt}: {got} (expected uint8 [out, in/2], scale [out, {groups}])")
        if tuple(self.zero.shape) != (out, groups):
            raise ValueError(f"{self.fmt}: zero points {tuple(self.zero.shape)}, expected {(out, groups)}")

    @property
    def out_features(self) -> int:
        return int(self.packed.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.packed.shape[1]) * 2

    def groups(self) -> Tensor:
        """The group of each input feature [in] (int64)."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.packed.device) // self.group_size

    def to(self, device: torch.device) -> Int4Weight:
        g_idx = None if self.g_idx is None else self.g_idx.to(device)
        return replace(self, packed=self.packed.to(device), scale=self.scale.to(device),
                       zero=self.zero.to(device), g_idx=g_idx)  # fmt: skip

    def values(self) -> Tensor:
        """The 4-bit integers q, uint8 [out, in]."""
        return torch.stack([self.packed & 0x0F, self.packed >> 4], dim=-1).reshape(self.out_features, -1)

    def dequantize(self) -> Tensor:
        """fp32 [out, in]."""
        if self.g_idx is None and self.in_features % self.group_size == 0:  # groups are runs: broadcast
            shape = (self.out_features, -1, self.group_size)
            q = self.values().view(shape).float() - self.zero.float().unsqueeze(-1)
            return (q * self.scale.float().unsqueeze(-1)).reshape(self.out_features, self.in_features)
        g = self.groups()
        q = self.values().float() - self.zero.float()[:, g]
        return q * self.scale.float()[:, g]


WQuantWeight = ScaledWeight | Int4Weight


def wquant_linear(x: Tensor, weight: WQuantWeight) -> Tensor:
    """x [T, in] @ dequantize(weight).T -> [T, out] in x's dtype (the oracle)."""
    return F.linear(x, weight.dequantize().to(x.dtype))


def stack(parts: list[WQuantWeight]) -> WQuantWeight | None:
    """The parts' rows one after another (q, k, v; gate, up) as one weight, or None
    where they cannot share one layout (different formats, group orders or block
    scales that do not tile the seam)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, Int4Weight):
        fours = [p for p in parts if isinstance(p, Int4Weight)]
        same = len(fours) == len(parts) and all(
            p.fmt == first.fmt and p.group_size == first.group_size and p.in_features == first.in_features
            and _same_g_idx(p.g_idx, first.g_idx) for p in fours
        )  # fmt: skip
        if not same:
            return None
        cat = [torch.cat([getattr(p, n) for p in fours]) for n in ("packed", "scale", "zero")]
        return Int4Weight(first.fmt, cat[0], cat[1], cat[2], first.group_size, first.g_idx)
    scaled = [p for p in parts if isinstance(p, ScaledWeight)]
    if len(scaled) != len(parts) or any(p.fmt != first.fmt or p.data.dtype != first.data.dtype for p in scaled):
        return None
    if all(p.block_in >= p.in_features for p in scaled):  # per tensor or per channel: per row after stacking
        scale = torch.cat([p.channel_scales() for p in scaled]).unsqueeze(1)
        return ScaledWeight(first.fmt, torch.cat([p.data for p in scaled]), scale, 1, first.in_features)
    if all(p.block_out == first.block_out and p.block_in == first.block_in and p.out_features % p.block_out == 0
           for p in scaled):  # fmt: skip
        return replace(first, data=torch.cat([p.data for p in scaled]), scale=torch.cat([p.scale for p in scaled]))
    return None


def _same_g_idx(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b))
