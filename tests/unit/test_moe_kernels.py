"""The mixture-of-experts op (kernels/moe_reference.py, the oracle) and its kernels:
the C++ CPU op (kernels/cpu_ops.py, moe_cpu.cpp) and the Triton grouped GEMM
(kernels/triton/moe.py, compiled on CUDA, under TRITON_INTERPRET=1 without a GPU),
for fp32 and bf16, top-1 and top-2, experts left without tokens, and a batch of none."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import cpu_ops, moe_reference, reference

ATOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
HIDDEN, INTER, EXPERTS = 48, 40, 6  # neither a multiple of the kernels' blocks


def problem(tokens: int, top_k: int, dtype: torch.dtype, seed: int = 0, skip_expert: int | None = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w_gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5).to(dtype)
    w_down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5).to(dtype)
    logits = torch.randn(tokens, EXPERTS, generator=g) * 3
    if skip_expert is not None:
        logits[:, skip_expert] = -1e9  # an expert no token selects
    ids, weights = moe_reference.select_experts(logits, top_k, renormalize=top_k > 1)
    return x, ids, weights, w_gate_up, w_down


def dense_moe(x, ids, weights, w_gate_up, w_down, activation):
    """Every expert over every token, masked by the routing: an independent oracle for
    the reference's per-expert loop."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(w_gate_up.shape[0]):
        gate, up = F.linear(x.float(), w_gate_up[e].float()).chunk(2, dim=-1)
        y = F.linear(reference.activate(gate, activation) * up, w_down[e].float())
        out += y * (weights * (ids == e)).sum(dim=-1, keepdim=True)
    return out


def test_select_experts_softmax_topk_renormalised():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    ids, weights = moe_reference.select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    _, renormed = moe_reference.select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(renormed, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_reference_matches_dense_masked_experts(activation):
    x, ids, weights, w_gate_up, w_down = problem(9, 2, torch.float32)
    out = moe_reference.fused_moe(x, ids, weights, w_gate_up, w_down, activation)
    torch.testing.assert_close(out, dense_moe(x, ids, weights, w_gate_up, w_down, activation), atol=1e-5, rtol=1e-5)


CASES = [(1, 1), (1, 2), (7, 2), (33, 2), (5, 3)]


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "top_k"), CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_cpu_fused_moe_matches_reference(tokens, top_k, dtype, activation):
    x, ids, weights, w_gate_up, w_down = problem(tokens, top_k, dtype, seed=tokens)
    expected = moe_reference.fused_moe(x, ids, weights, w_gate_up, w_down, activation)
    packed = cpu_ops.pack_experts(w_gate_up, gated=True), cpu_ops.pack_experts(w_down, gated=False)
    out = cpu_ops.fused_moe(x, ids, weights, *packed, activation, intermediate_size=INTER)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")
def test_cpu_fused_moe_empty_batch_and_bad_expert_id():
    x, ids, weights, w_gate_up, w_down = problem(3, 2, torch.float32)
    packed = cpu_ops.pack_experts(w_gate_up, gated=True), cpu_ops.pack_experts(w_down, gated=False)
    empty = cpu_ops.fused_moe(x[:0], ids[:0], weights[:0], *packed, "silu", intermediate_size=INTER)
    assert empty.shape == (0, HIDDEN)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.fused_moe(x, ids + EXPERTS, weights, *packed, "silu", intermediate_size=INTER)


def test_align_by_expert_groups_pairs_in_whole_blocks():
    from kernels.triton.moe import align_by_expert

    ids = torch.tensor([[3, 0], [0, 1], [3, 0]])
    sorted_pairs, block_expert = align_by_expert(ids, 4, 2)
    # expert 0: pairs 1, 2, 5 (padded to 4); expert 1: pair 3 (2); expert 3: pairs 0, 4
    assert sorted_pairs.tolist() == [1, 2, 5, 6, 3, 6, 0, 4]
    assert block_expert.tolist() == [0, 0, 1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (7, 2), (33, 2)])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_triton_fused_moe_matches_reference(tokens, top_k, dtype, activation):
    from kernels.triton import moe as triton_moe

    x, ids, weights, w_gate_up, w_down = problem(tokens, top_k, dtype, seed=tokens)
    expected = moe_reference.fused_moe(x, ids, weights, w_gate_up, w_down, activation)
    device = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
    on_device = (t.to(device) for t in (x, ids, weights, w_gate_up, w_down))
    out = triton_moe.fused_moe(*on_device, activation, intermediate_size=INTER).cpu()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])
