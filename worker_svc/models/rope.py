"""Rotary position embeddings: every rope_type the served families use, as one
table per set of parameters.

A table holds the inverse frequencies of the rotated dimensions and the factor
that scales cos/sin (yarn's and longrope's attention factor). Longrope is served
with its short factors up to original_max_position_embeddings (`max_len`, which
caps max_model_len): once a sequence passes that length transformers drops its
cache and recomputes the whole sequence with the long factors (every layer's keys
change, not just their rotation), which needs a per-sequence table choice and a
recompute that the scheduler would drive (docs/design.md); that is not built, so
longer sequences are not served rather than served differently.

Partial rotary (Phi-3's partial_rotary_factor): only the first `rotary_dim` dims
of a head rotate, pairing dim i with i + rotary_dim / 2. The checkpoint's q/k
rows are permuted at load so those pairs sit at i and i + head_dim / 2
(`partial_rotary_permutation`) and the other dims get inverse frequency 0 (cos
1, sin 0: left exactly as they are), so every backend's full-width rotate-half
op rotates the right dims and q.k is unchanged by the permutation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from worker_svc.models.errors import UnsupportedModel

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeTable:
    inv_freq: tuple[float, ...]  # head_dim / 2 entries; 0 for dims that do not rotate
    attention_factor: float = 1.0
    max_len: int = 0  # the longest sequence the table serves as transformers does (0: any)
    rotary_pairs: int = 0  # the rotated (dim, dim + half) pairs: only they take attention_factor


def rope_table(params: dict[str, Any], head_dim: int, rotary_dim: int, max_position: int) -> RopeTable:
    """The table of one rope parameter set (a config's rope_parameters, or one layer type's)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        supported = ", ".join(ROPE_TYPES)
        raise UnsupportedModel(f"rope_parameters.rope_type {rope_type!r} is not supported (supported: {supported})")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    factor = params.get("factor")
    attention_factor = 1.0
    max_len = 0
    if rope_type == "linear":
        inv_freq = inv_freq / float(factor)  # type: ignore[arg-type]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(base, rotary_dim, params, max_position)
    elif rope_type == "longrope":
        original = int(params["original_max_position_embeddings"])
        factor = float(factor) if factor is not None else max_position / original
        attention_factor = _longrope_attention_factor(params, factor, original)
        inv_freq = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float32) * base**exponents)
        max_len = original
    # "dynamic" (NTK) rescales only past max_position_embeddings, which max_model_len
    # never exceeds: within it the frequencies are the default ones.
    pad = [0.0] * ((head_dim - rotary_dim) // 2)
    return RopeTable(
        tuple(inv_freq.tolist()) + tuple(pad),
        attention_factor,
        max_len,
        rotary_dim // 2,
    )


def rope_cos_sin(
    positions: torch.Tensor, table: RopeTable, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, head_dim] for positions [T], in fp32 then cast, as transformers
    computes them; inv_freq is table.inv_freq on the device."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if table.attention_factor != 1.0:
        # Partial rotary: the dims that do not rotate keep cos 1, sin 0 exactly.
        half = torch.arange(inv_freq.shape[0], device=inv_freq.device) < table.rotary_pairs
        factor = torch.where(half, table.attention_factor, 1.0).repeat(2)
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def partial_rotary_rows(head_dim: int, rotary_dim: int, heads: int) -> torch.Tensor:
    """The row order of a q or k projection of `heads` heads under partial rotary:
    partial_rotary_permutation within each head (its weights, and a LoRA B's rows)."""
    order = partial_rotary_permutation(head_dim, rotary_dim)
    return (order[None, :] + head_dim * torch.arange(heads)[:, None]).flatten()


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order within one head that puts rotary pair (i, i + rotary_dim/2) at
    (i, i + head_dim/2) and the pass-through dims after each half's rotary ones."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    passed = list(range(rotary_dim, head_dim))
    pass_half = len(passed) // 2
    first = list(range(rot_half)) + passed[:pass_half]
    second = list(range(rot_half, rotary_dim)) + passed[pass_half:]
    assert len(first) == len(second) == half
    return torch.tensor(first + second)


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(base: float, dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    # YaRN: frequencies that rotate fewer than beta_slow times over the original
    # context are interpolated (divided by factor), those over beta_fast kept, a
    # linear ramp between; cos/sin are scaled by the attention factor.
    original = float(params["original_max_position_embeddings"])
    factor = float(params["factor"]) if params.get("factor") is not None else max_position / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor, 1.0)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_attention_factor(params: dict[str, Any], factor: float, original: int) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
