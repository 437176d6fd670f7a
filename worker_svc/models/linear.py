"""A linear layer's weight, in the layout this device multiplies fastest.

On CPU, with the C++ kernels built and the fused forward on (not --enforce-eager):
fp32 and bf16 weights are packed once, at load, into the layout
kernels/csrc/linear_cpu.cpp streams (kernels.cpu_ops.pack_linear), one copy, used
for every batch size. A decode step's time is its weights' read, and that layout
reads them as one sequential stream: one token's 269 MB of bf16 weights in 13.9 ms
on one thread against 21.3 ms through oneDNN's packed weights, fp32 24.4 against
35.9 ms through MKL's; at a prefill's thousands of rows it keeps oneDNN's pace
(bench/results/peers.md). The gate-up projection of a gated MLP multiplies into
its activation (GatedLinear), so the [T, 2 x intermediate] product is never written.

Otherwise (--enforce-eager, the per-op path, or no kernels): bf16 weights are
reordered once into oneDNN's blocked format (F.linear would reorder the plain
[out, in] matrix on every call, which at decode batch sizes costs about as much as
the multiply); fp32 weights stay plain, as transformers multiplies them; CUDA
weights stay plain too (cuBLAS needs no reorder).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kernels import cpu_ops

# The oneDNN reorder is tuned for a batch size; decode batches are tens of rows.
_PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    mkldnn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and mkldnn


def cpu_kernel_takes(weight: torch.Tensor) -> bool:
    """Whether kernels/csrc/linear_cpu.cpp can multiply this weight here."""
    return weight.device.type == "cpu" and weight.dtype in cpu_ops.LINEAR_DTYPES and cpu_ops.available()


class Projection(Protocol):
    """What the decoder calls a projection: x [T, in] -> [T, out]. A Linear, or a
    tensor-parallel wrapper of one (parallel/layers.py)."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in]. cpu_kernel: packed for the C++
    kernel where it takes the weight (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, pack: bool = True, cpu_kernel: bool = False):
        self.out_features, self.in_features = weight.shape
        self.kernel = ""  # plain: F.linear
        if cpu_kernel and cpu_kernel_takes(weight):
            self.kernel = "cpu"
        elif pack and can_pack(weight):
            self.kernel = "onednn"
        # Only one copy is kept: a packed one replaces the plain weight.
        if self.kernel == "cpu":
            self.weight = cpu_ops.pack_linear(weight)
        elif self.kernel == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        else:
            self.weight = weight

    @property
    def packed(self) -> bool:
        return self.kernel != ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu":
            return cpu_ops.linear(x, self.weight, self.out_features, self.in_features)
        if self.kernel == "onednn":
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
            return out
        return F.linear(x, self.weight)


def activate(gate: torch.Tensor, activation: str) -> torch.Tensor:
    """The gated MLP's activation: silu, or gelu with the tanh approximation (Gemma)."""
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


class GatedLinear:
    """act(x @ gate.T) * (x @ up.T) for weight = [gate; up] [2 x intermediate, in]: the
    fused gate-up projection of a gated MLP and its activation. The C++ kernel
    computes both halves' rows of an output column together; elsewhere a Linear over
    the stacked weight, then the activation in torch."""

    def __init__(self, weight: torch.Tensor, activation: str, cpu_kernel: bool = False):
        self.activation = activation
        self.out_features, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self.fused = cpu_kernel and cpu_kernel_takes(weight)
        self.weight = cpu_ops.pack_linear(weight, gated=True) if self.fused else None
        self.linear = None if self.fused else Linear(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear is None:
            assert self.weight is not None
            return cpu_ops.linear(x, self.weight, self.out_features, self.in_features, self.activation)
        gate, up = self.linear(x).chunk(2, dim=-1)
        return activate(gate, self.activation) * up
