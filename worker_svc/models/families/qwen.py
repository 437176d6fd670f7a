"""Qwen2/2.5 (biases on q/k/v, not o) and Qwen3 (RMSNorm per head on q and k).
Both may name sliding-window layers (use_sliding_window, max_window_layers):
transformers turns those into layer_types, which spec.py reads."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.registry import Family, register

SLIDING = frozenset({"sliding_window", "use_sliding_window"})


def _qwen3(cfg: PretrainedConfig) -> dict[str, Any]:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias}


register(
    Family(
        "qwen2",
        "Qwen/Qwen2.5-0.5B-Instruct, Qwen2.5-7B-Instruct, Qwen2.5-Coder-7B-Instruct",
        switches=lambda cfg: {"qkv_bias": True},
        honours=SLIDING,
    )
)
register(Family("qwen3", "Qwen/Qwen3-0.6B, Qwen3-8B", switches=_qwen3, honours=SLIDING | {"attention_bias"}))
