"""Mixture-of-experts families: sparse MoE blocks in place of (some) MLPs
(models/moe.py), attention as Llama's.

* Qwen3-MoE: q/k norms per head (as Qwen3), top-k of the softmax, renormalised
  when norm_topk_prob; layer i is sparse unless it is in mlp_only_layers or
  (i + 1) % decoder_sparse_step != 0 (those keep a dense MLP of intermediate_size);
  sliding_window on every layer when use_sliding_window.
* Qwen2-MoE: Qwen2's attention (q/k/v biases, qkv_bias; sliding layers from
  layer_types), Qwen3-MoE's routing and sparse layers, plus a shared expert in
  every sparse block (shared_expert_intermediate_size wide, gated by
  sigmoid(shared_expert_gate x); models/moe.py).
* Mixtral: top-k of the softmax, always renormalised, every layer sparse; experts'
  w1/w3/w2 are the gate/up/down projections (renamed here to those names); a
  sliding window on every layer where the config sets one.

router_aux_loss_coef, output_router_logits and router_jitter_noise only act in
training: inference math does not read them.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

import torch
from transformers import PretrainedConfig

from worker_svc.models.families.mistral import every_layer_window
from worker_svc.models.families.qwen import SLIDING
from worker_svc.models.moe import MoeSpec
from worker_svc.models.registry import Family, Shapes, register


def _qwen_moe(cfg: PretrainedConfig, shared_size: int = 0) -> MoeSpec:
    """Qwen's sparse layers: not in mlp_only_layers and every decoder_sparse_step-th."""
    dense = set(cfg.mlp_only_layers)
    sparse = tuple(
        i not in dense and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
        for i in range(cfg.num_hidden_layers)
    )
    top_k, width = cfg.num_experts_per_tok, cfg.moe_intermediate_size
    return MoeSpec(cfg.num_experts, top_k, width, cfg.norm_topk_prob, sparse, shared_size)


def _qwen3_moe(cfg: PretrainedConfig) -> dict[str, Any]:
    bias = bool(getattr(cfg, "attention_bias", False))
    return {"qk_norm": "head", "qkv_bias": bias, "o_bias": bias, "moe": _qwen_moe(cfg), **every_layer_window(cfg)}


def _qwen2_moe(cfg: PretrainedConfig) -> dict[str, Any]:
    return {"qkv_bias": bool(cfg.qkv_bias), "moe": _qwen_moe(cfg, cfg.shared_expert_intermediate_size)}


def _mixtral(cfg: PretrainedConfig) -> dict[str, Any]:
    sparse = (True,) * cfg.num_hidden_layers
    moe = MoeSpec(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, True, sparse)
    return {"moe": moe, **every_layer_window(cfg)}


def _mixtral_names(spec: Shapes, tensors: MutableMapping[str, torch.Tensor]) -> None:
    """Mixtral's block_sparse_moe.gate and experts.E.w1/w3/w2 -> the canonical MoE names,
    for the experts the config declares (another expert keeps its name, and is refused by it)."""
    assert spec.moe is not None
    for i in range(spec.num_layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        if old + "gate.weight" in tensors:
            tensors[new + "gate.weight"] = tensors.pop(old + "gate.weight")
        for e in range(spec.moe.num_experts):
            for w, proj in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                name = f"{old}experts.{e}.{w}.weight"
                if name in tensors:
                    tensors[f"{new}experts.{e}.{proj}.weight"] = tensors.pop(name)


register(
    Family(
        "qwen3_moe",
        "Qwen/Qwen3-30B-A3B-Instruct-2507, Qwen3-235B-A22B",
        switches=_qwen3_moe,
        honours=frozenset({"sliding_window", "use_sliding_window", "attention_bias"}),
    )
)
register(
    Family(
        "qwen2_moe",
        "Qwen/Qwen1.5-MoE-A2.7B-Chat, Qwen2-57B-A14B-Instruct",
        switches=_qwen2_moe,
        honours=SLIDING | {"qkv_bias"},
    )
)
register(
    Family(
        "mixtral",
        "mistralai/Mixtral-8x7B-Instruct-v0.1, Mixtral-8x22B-Instruct-v0.1",
        switches=_mixtral,
        honours=frozenset({"sliding_window"}),
        canonical=_mixtral_names,
    )
)
