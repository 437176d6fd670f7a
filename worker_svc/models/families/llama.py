"""Llama (and the many checkpoints that reuse its architecture), with optional
biases: attention_bias on q/k/v/o, mlp_bias on gate/up/down."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.registry import Family, register


def biases(cfg: PretrainedConfig) -> dict[str, Any]:
    attention = bool(getattr(cfg, "attention_bias", False))
    return {"qkv_bias": attention, "o_bias": attention, "mlp_bias": bool(getattr(cfg, "mlp_bias", False))}


register(
    Family(
        "llama",
        "meta-llama/Llama-3.2-1B-Instruct, Llama-3.1-8B-Instruct, HuggingFaceTB/SmolLM2-135M-Instruct",
        switches=biases,
        honours=frozenset({"attention_bias", "mlp_bias"}),
    )
)
