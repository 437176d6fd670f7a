"""The mixture-of-experts op, in torch: the oracle the C++ (kernels/cpu_ops.py) and
Triton (kernels/triton/moe.py) kernels are tested against, and the op of the
`torch` backend.

A sparse MoE block is a router (a linear to num_experts logits, then
`select_experts`) and `fused_moe`: every token's top-k experts, each a gated MLP,
summed with the router's weights. Every backend's `fused_moe` has one signature:

    fused_moe(x [T, H], topk_ids [T, K] int, topk_weights [T, K] fp32,
              w_gate_up, w_down, activation, intermediate_size) -> [T, H]

with the experts' weights in the backend's layout: here (and for Triton) plain
w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows) and w_down
[E, H, I]; the C++ kernel's are packed once at load (cpu_ops.pack_experts). The
sum runs over experts in index order, each term weight * expert(x) in fp32, as
transformers' experts loop adds them, rounded once to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.reference import activate


def select_experts(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """(topk_ids [T, K] int64, topk_weights [T, K] fp32): softmax over the experts in
    fp32, the top k, renormalised to sum to 1 where the family does (Mixtral always,
    Qwen3-MoE with norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def fused_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    intermediate_size: int | None = None,
) -> Tensor:
    """sum_k topk_weights[t, k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k].
    Loops over the experts, each over the tokens routed to it."""
    inter = w_gate_up.shape[1] // 2
    assert intermediate_size in (None, inter), "intermediate_size does not match w_gate_up"
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w_gate_up.shape[0]):
        tokens, slots = torch.where(topk_ids == e)
        if tokens.numel() == 0:
            continue
        gate, up = F.linear(x[tokens], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(activate(gate, activation) * up, w_down[e])
        out.index_add_(0, tokens, y.float() * topk_weights[tokens, slots, None].float())
    return out.to(x.dtype)
