"""Stateless layer math shared by every family (pure functions on tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker_svc.models.linear import Projection


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32; `weight` already includes any family offset (Gemma's 1 + w)."""
    # torch's fused kernel, in fp32 (weight is fp32): one pass instead of six
    # elementwise ones, and the same result as x * rsqrt(mean(x^2) + eps) * weight.
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for positions [T] (computed in fp32, like the reference)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], rotate-half convention (Llama/Qwen/Gemma checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def gated_mlp(x: torch.Tensor, gate_up: Projection, down: Projection, activation: str) -> torch.Tensor:
    """gate_up and down are the projections (callables x -> x @ W.T, models/linear.py)."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    if activation == "silu":
        act = F.silu(gate)
    else:
        act = F.gelu(gate, approximate="tanh")
    return down(act * up)
