"""Sparse mixture-of-experts blocks (Qwen3-MoE, Mixtral, Qwen2-MoE): a router and the
experts, run as one op per backend (kernels/moe_reference.py's fused_moe signature),
and where the family has one (Qwen2-MoE) a shared expert every token takes: a dense
gated MLP scaled by sigmoid(shared_expert_gate x), added to the routed experts' sum.

The router is a plain linear to num_experts logits, multiplied as transformers does
(F.linear in the model's dtype): a top-k choice must not flip on a different
summation order. The experts' weights are taken from the checkpoint's per-expert
tensors (Llama's gate/up/down names under mlp.experts.{e}, families/ rename
Mixtral's w1/w3/w2) and stacked once, in the layout of the backend that runs them:
packed for the C++ kernel on the CPU (kernels/moe_cpu.cpp), plain [E, 2I, H] and
[E, H, I] for Triton on CUDA and for the torch reference elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_ops, moe_reference
from worker_svc.models.linear import Projection, cpu_kernel_takes
from worker_svc.models.projections import gated_projection, projection


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block (else the dense MLP)
    shared_intermediate_size: int = 0  # the shared expert's width (Qwen2-MoE); 0: none


@dataclass(frozen=True)
class SharedExpert:
    """sigmoid(x @ gate.T) * down(act(x @ w_gate.T) * (x @ w_up.T)): every token's.
    Under tensor parallelism `mlp` is this rank's columns (a partial sum, as the
    routed experts' is) and the scalar gate is whole, so the ranks' sum is exact."""

    mlp_in: Projection  # gate and up with the activation, fused
    mlp_out: Projection  # down
    gate: torch.Tensor  # [1, hidden]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp_out(self.mlp_in(x))


MoeOp = Callable[..., torch.Tensor]


def _backend(weight: torch.Tensor, cpu_kernel: bool) -> tuple[MoeOp, str]:
    if cpu_kernel and cpu_kernel_takes(weight):
        return cpu_ops.fused_moe, "cpu"
    if weight.device.type == "cuda":
        from kernels.triton import moe as triton_moe

        return triton_moe.fused_moe, "triton"
    return moe_reference.fused_moe, "torch"


class SparseMoe:
    """x [T, H] -> sum over each token's top-k experts of weight * expert(x)."""

    def __init__(
        self,
        spec: MoeSpec,
        router: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        activation: str,
        cpu_kernel: bool,
        shared: SharedExpert | None = None,
    ):
        self.spec = spec
        self.router = router
        self.shared = shared
        self.activation = activation
        self.op, self.kernel = _backend(w_gate_up, cpu_kernel)
        if self.kernel == "cpu":  # one copy: the packed one replaces the plain weights
            w_gate_up, w_down = cpu_ops.pack_experts(w_gate_up, gated=True), cpu_ops.pack_experts(w_down, gated=False)
        self.w_gate_up, self.w_down = w_gate_up, w_down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = moe_reference.select_experts(F.linear(x, self.router), self.spec.top_k, self.spec.renormalize)
        routed = self.op(
            x, ids, weights, self.w_gate_up, self.w_down, self.activation, intermediate_size=self.spec.intermediate_size
        )
        return routed if self.shared is None else routed + self.shared(x)


def load_sparse_moe(
    spec: MoeSpec, prefix: str, take: Callable[[str], torch.Tensor], activation: str, cpu_kernel: bool
) -> SparseMoe:
    """The block at `prefix` ("model.layers.{i}.mlp."), each tensor taken once."""
    experts = [f"{prefix}experts.{e}." for e in range(spec.num_experts)]
    gate_up = torch.stack([torch.cat([take(e + "gate_proj.weight"), take(e + "up_proj.weight")]) for e in experts])
    down = torch.stack([take(e + "down_proj.weight") for e in experts])
    shared = None
    if spec.shared_intermediate_size:
        mlp = prefix + "shared_expert."
        shared = SharedExpert(
            gated_projection(
                take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight"), None, activation, cpu_kernel
            ),
            projection([take(mlp + "down_proj.weight")], None, cpu_kernel),
            take(prefix + "shared_expert_gate.weight"),
        )
    return SparseMoe(spec, take(prefix + "gate.weight"), gate_up, down, activation, cpu_kernel, shared)
