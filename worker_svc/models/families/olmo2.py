"""OLMo 2: norms only after attention and after the MLP (no pre-norms), and q/k
RMSNorms over the whole projection, before it is split into heads."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from worker_svc.models.registry import Family, register


def _olmo2(cfg: PretrainedConfig) -> dict[str, Any]:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {"norms": "post", "qk_norm": "full", "qkv_bias": bias, "o_bias": bias}


register(
    Family(
        "olmo2",
        "allenai/OLMo-2-0425-1B-Instruct, OLMo-2-1124-7B-Instruct",
        switches=_olmo2,
        honours=frozenset({"attention_bias"}),
    )
)
