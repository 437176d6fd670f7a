"""The batched LoRA op in Triton (kernels/lora_reference.py's lora, the oracle;
tested under TRITON_INTERPRET=1): y[t] = b[slot] @ (a[slot] @ x[t]) with each
token's adapter slot read on the device, one program per (token, BLOCK_N output
columns), as vLLM's BGMV kernels do. Nothing about the slots reaches the host or
the launch grid (its shape is the step's tokens), so a captured CUDA graph replays
it for any mix of adapters: the slot column is data in the graph's input buffer.

Each program shrinks its token's row to the rank (fp32 sums, rounded to x's dtype
as the reference's two chained matmuls round it), then expands its output columns.
Slot 0 (the base model, all zeros) loads nothing and stores zeros. The shrink is
recomputed by each of a row's out / BLOCK_N programs: R x in multiply-adds, small
beside the expand's block at the ranks served; a split shrink-then-expand (SGMV,
grouped by slot) for long prefills is a GPU tuning step still to measure.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_K, BLOCK_N = 64, 64


@triton.jit
def _lora_kernel(
    x_ptr, a_ptr, b_ptr, slots_ptr, y_ptr, in_features, rank, out_features,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    r_mask = rs < tl.where(slot != 0, rank, 0)  # the base's slot reads nothing
    a_slot = a_ptr + slot * rank * in_features
    h = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xk = tl.load(x_ptr + t * in_features + k, mask=k_mask, other=0.0).to(tl.float32)
        ak = tl.load(a_slot + rs[:, None] * in_features + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        h += tl.sum(ak.to(tl.float32) * xk[None, :], axis=1)
    h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < out_features
    b_slot = b_ptr + slot * out_features * rank
    bt = tl.load(b_slot + cols[:, None] * rank + rs[None, :], mask=col_mask[:, None] & r_mask[None, :], other=0.0)
    y = tl.sum(bt.to(tl.float32) * h[None, :], axis=1)
    tl.store(y_ptr + t * out_features + cols, y.to(y_ptr.dtype.element_ty), mask=col_mask)


def lora(x: Tensor, a: Tensor, b: Tensor, slots: Tensor) -> Tensor:
    """lora_reference.lora, one program per (token, BLOCK_N output columns)."""
    tokens, in_features = x.shape
    rank, out_features = a.shape[1], b.shape[1]
    y = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return y
    x, a, b = x.contiguous(), a.contiguous(), b.contiguous()
    grid = (tokens, triton.cdiv(out_features, BLOCK_N))
    _lora_kernel[grid](
        x, a, b, slots, y, in_features, rank, out_features,
        BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return y
