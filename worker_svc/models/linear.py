"""A linear layer's weight, in the layout this device multiplies fastest.

On CPU, bf16 weights are reordered once, at load, into oneDNN's blocked format:
F.linear would reorder the plain [out, in] matrix on every call, which at decode
batch sizes costs about as much as the multiply (bench/results/vs_transformers.md).
fp32 weights stay plain, so the fp32 exactness tests run the same matmul as
transformers; CUDA weights stay plain too (cuBLAS needs no reorder).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

# The reorder is tuned for a batch size; decode batches are tens of rows.
_PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    mkldnn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and mkldnn


class Projection(Protocol):
    """What the decoder calls a projection: x [T, in] -> [T, out]. A Linear, or a
    tensor-parallel wrapper of one (parallel/layers.py)."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in]."""

    def __init__(self, weight: torch.Tensor, pack: bool = True):
        self.out_features, self.in_features = weight.shape
        self.packed = pack and can_pack(weight)
        # Only one copy is kept: the packed one replaces the plain weight.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
            return out
        return F.linear(x, self.weight)
