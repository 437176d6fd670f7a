"""Granite (3.x): Llama with four multipliers: embeddings, each block's output
before the residual add, the attention scores (in place of head_dim ** -0.5),
and the logits (divided by logits_scaling)."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.families.llama import biases
from worker_svc.models.registry import Family, register

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _granite(cfg: PretrainedConfig) -> dict[str, Any]:
    return {
        **biases(cfg),
        "embed_scale": float(cfg.embedding_multiplier),
        "residual_scale": float(cfg.residual_multiplier),
        "attention_scale": float(cfg.attention_multiplier),
        "logits_divisor": float(cfg.logits_scaling),
    }


register(
    Family(
        "granite",
        "ibm-granite/granite-3.3-2b-instruct, granite-3.1-8b-instruct",
        switches=_granite,
        honours=frozenset({"attention_bias", "mlp_bias", *MULTIPLIERS}),
    )
)
