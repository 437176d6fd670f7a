"""The mixture-of-experts op in Triton (kernels/moe_reference.py's fused_moe, the
oracle; tested under TRITON_INTERPRET=1): a grouped GEMM over the tokens sorted by
expert, so only the selected experts' weights are read.

The (token, slot) pairs are sorted by expert and each expert's run padded to a
whole number of BLOCK_M rows (`align_by_expert`): every row block belongs to one
expert. Two launches follow: the gate-up projection with the activation
(act(gate) * up, [pairs, I], never the [pairs, 2I] product), then the down
projection times each pair's router weight, into one fp32 row per pair; the k
slots of a token are summed at the end and rounded once to x's dtype. Tiles are
widened to fp32 and multiplied with IEEE fp32 dots (the reference's sums, and what
the interpreter computes for bf16); tensor-core bf16 dots are a GPU tuning step
still to measure.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def align_by_expert(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """(sorted_pairs [padded] int64: pair indices t * K + k grouped by expert, each
    expert's run padded to a multiple of block_m with the sentinel T * K;
    block_expert [padded // block_m] int32: the expert of each row block)."""
    flat = topk_ids.flatten().long()
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    expert = flat[order]
    position = padded_start[expert] + torch.arange(pairs, device=flat.device) - start[expert]
    sorted_pairs = torch.full((int(padded.sum()),), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[position] = order
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=flat.device), padded // block_m)
    return sorted_pairs, block_expert.to(torch.int32)


@triton.jit
def _activate(g, ACT: tl.constexpr):
    if ACT == 0:
        return g * tl.sigmoid(g)
    # gelu, tanh approximation: tanh(z) = 2 * sigmoid(2z) - 1
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 * tl.sigmoid(2.0 * z))


@triton.jit
def _row_block(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M: tl.constexpr):
    """This program's row block: its expert, its rows of the sorted pairs, their
    pair indices and which are real (not padding)."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    return expert, rows, pair, pair < num_pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, h_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
    ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert, rows, pair, valid = _row_block(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    token = pair // top_k
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * 2 * inter * hidden
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        a_mask = valid[:, None] & (k[None, :] < hidden)
        a = tl.load(x_ptr + token[:, None] * hidden + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
        w_mask = (k[:, None] < hidden) & (cols[None, :] < inter)
        gate = tl.load(w_expert + cols[None, :] * hidden + k[:, None], mask=w_mask, other=0.0).to(tl.float32)
        up = tl.load(w_expert + (cols[None, :] + inter) * hidden + k[:, None], mask=w_mask, other=0.0).to(tl.float32)
        acc_gate += tl.dot(a, gate, input_precision="ieee")
        acc_up += tl.dot(a, up, input_precision="ieee")
    h = _activate(acc_gate, ACT) * acc_up
    out_mask = valid[:, None] & (cols[None, :] < inter)
    tl.store(h_ptr + rows[:, None] * inter + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_pairs, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    expert, rows, pair, valid = _row_block(sorted_ptr, block_expert_ptr, num_pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + expert * hidden * inter
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        a_mask = valid[:, None] & (k[None, :] < inter)
        a = tl.load(h_ptr + rows[:, None] * inter + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
        w_mask = (k[:, None] < inter) & (cols[None, :] < hidden)
        w = tl.load(w_expert + cols[None, :] * inter + k[:, None], mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.dot(a, w, input_precision="ieee")
    weight = tl.load(weights_ptr + pair, mask=valid, other=0.0)
    acc = acc * weight[:, None]
    tl.store(out_ptr + pair[:, None] * hidden + cols[None, :], acc, mask=valid[:, None] & (cols[None, :] < hidden))


def fused_moe(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w_gate_up: Tensor,
    w_down: Tensor,
    activation: str = "silu",
    intermediate_size: int | None = None,
) -> Tensor:
    """moe_reference.fused_moe as a grouped GEMM over the selected experts."""
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    assert intermediate_size in (None, inter), "intermediate_size does not match w_gate_up"
    top_k = topk_ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    x, w_gate_up, w_down = x.contiguous(), w_gate_up.contiguous(), w_down.contiguous()
    sorted_pairs, block_expert = align_by_expert(topk_ids, num_experts, BLOCK_M)
    blocks = block_expert.numel()
    h = torch.empty((sorted_pairs.numel(), inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, w_gate_up, h, sorted_pairs, block_expert, pairs, top_k, hidden, inter,
        ACT=ACTIVATIONS[activation], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.float().contiguous()
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        h, w_down, out, weights, sorted_pairs, block_expert, pairs, hidden, inter,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
