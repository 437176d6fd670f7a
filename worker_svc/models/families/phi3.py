"""Phi-3 / Phi-3.5 / Phi-4-mini: fused qkv_proj and gate_up_proj (split here into
the Llama names, so tensor parallelism and the decoder see one layout), longrope
(its short factors, up to original_max_position_embeddings), partial_rotary_factor
(both in rope.py), and a sliding window on every layer where the config sets one."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from worker_svc.models.families.mistral import every_layer_window
from worker_svc.models.registry import Family, Shapes, register


def split_fused(spec: Shapes, tensors: MutableMapping[str, torch.Tensor]) -> None:
    q_size, kv_size = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    for i in range(spec.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q, k, v = torch.split(tensors.pop(attn + "qkv_proj.weight"), [q_size, kv_size, kv_size])
        tensors.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        gate, up = tensors.pop(mlp + "gate_up_proj.weight").chunk(2)  # transformers: gate first
        tensors.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up})


register(
    Family(
        "phi3",
        "microsoft/Phi-3-mini-4k-instruct, Phi-3.5-mini-instruct (longrope), Phi-4-mini-instruct (partial rotary)",
        switches=every_layer_window,
        honours=frozenset({"sliding_window", "partial_rotary_factor"}),
        canonical=split_fused,
    )
)
