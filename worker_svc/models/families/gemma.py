"""Gemma 2 and Gemma 3 (text): RMSNorm weights stored as w - 1, embeddings times
sqrt(hidden), sandwich norms around attention and the MLP, GELU (tanh), scores
scaled by query_pre_attn_scalar, alternating sliding-window layers (layer_types);
Gemma 3 adds q/k norms per head and per-layer-type RoPE, Gemma 2 soft-caps the
attention scores (the attention op's softcap, in every backend) and the final
logits."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.registry import Family, register


def _gemma(cfg: PretrainedConfig) -> dict[str, Any]:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {
        "attention_scale": float(cfg.query_pre_attn_scalar) ** -0.5,
        "norms": "sandwich",
        "norm_offset": 1.0,
        "embed_scale": cfg.hidden_size**0.5,
        "final_softcap": float(getattr(cfg, "final_logit_softcapping", None) or 0.0),
        "attn_softcap": float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
        "qkv_bias": bias,
        "o_bias": bias,
    }


HONOURS = frozenset(
    {"query_pre_attn_scalar", "sliding_window", "final_logit_softcapping", "attn_logit_softcapping", "attention_bias"}
)

register(Family("gemma2", "google/gemma-2-2b-it, gemma-2-9b-it", switches=_gemma, honours=HONOURS))
register(
    Family(
        "gemma3_text",
        "google/gemma-3-1b-it, gemma-3-270m",
        switches=lambda cfg: {**_gemma(cfg), "qk_norm": "head"},
        honours=HONOURS,
    )
)
