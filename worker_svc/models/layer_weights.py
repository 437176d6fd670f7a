"""A decoder layer's weights, as models/decoder.py loads them and runs them (the
Python loop, or models/layer_loop.py's one C++ call)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.models.linear import Projection


@dataclass
class LayerWeights:
    qkv: Projection  # q, k, v projections fused: one matmul
    o: Projection
    gate_up: Projection | None  # act(gate) * up: the gate and up projections fused with the activation
    down: Projection | None  # (both None in a mixture-of-experts layer: `moe`)
    attn_norm: torch.Tensor | None  # before attention (None: OLMo 2 norms only after)
    mlp_norm: torch.Tensor | None  # before the MLP
    post_attn_norm: torch.Tensor | None = None  # Gemma sandwich norms, OLMo 2 post-norms
    post_mlp_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: Projection | None = None  # a sparse mixture-of-experts block in place of the MLP
