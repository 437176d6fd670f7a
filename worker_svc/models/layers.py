"""Stateless layer math shared by every family (pure functions on tensors)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32; `weight` already includes any family offset (Gemma's 1 + w)."""
    # torch's fused kernel, in fp32 (weight is fp32): one pass instead of six
    # elementwise ones, and the same result as x * rsqrt(mean(x^2) + eps) * weight.
    return F.rms_norm(x.float(), weight.shape, weight.float(), eps).to(x.dtype)
