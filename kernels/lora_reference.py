"""The batched LoRA op, in torch: the oracle the C++ (kernels/cpu_ops.py) and Triton
(kernels/triton/lora.py) kernels are tested against, and the op wherever neither runs.

Every token of a step runs through the adapter in its slot (0 = the base model):

    lora(x [T, in], a [S, R, in], b [S, out, R], slots [T] int64) -> [T, out]
    y[t] = b[slots[t]] @ (a[slots[t]] @ x[t])

the shrink to rank R, then the expand, with the adapter's scaling already folded
into b (worker_svc/lora/slots.py). A and B are stacked over the slots and padded to
the worker's --max-lora-rank with zero rows of A and columns of B, so an adapter of
lower rank adds exact zeros; slot 0 holds zeros, and every backend skips its tokens
(they add nothing). The tokens are grouped by slot, each group one shrink and one
expand (the SGMV idea); the result is in x's dtype, the shrink rounded to it between
the two multiplies as two chained nn.Linear layers round it.
"""

from __future__ import annotations

import torch
from torch import Tensor


def lora(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    out = x.new_zeros(x.shape[0], b.shape[1])
    for slot in range(1, a.shape[0]):
        rows = torch.nonzero(slots == slot).squeeze(1)
        if rows.numel():
            out.index_copy_(0, rows, (x[rows] @ a[slot].T) @ b[slot].T)
    return out
