"""Mistral: Llama with an explicit head_dim and a sliding window on every layer."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.registry import Family, register


def every_layer_window(cfg: PretrainedConfig) -> dict[str, Any]:
    """sliding_window (None: full attention) on every layer, as transformers masks it."""
    return {"layer_windows": (int(cfg.sliding_window or 0),) * cfg.num_hidden_layers}


register(
    Family(
        "mistral",
        "mistralai/Mistral-7B-Instruct-v0.3, Mistral-7B-v0.1 (window 4096)",
        switches=every_layer_window,
        honours=frozenset({"sliding_window"}),
    )
)
