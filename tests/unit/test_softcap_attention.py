"""Gemma 2's attention soft-cap (attn_logit_softcapping) in every backend's attention
op: the torch reference against transformers' own eager Gemma 2 attention, then the
C++ CPU kernel and the Triton kernels (under the interpreter without a GPU) against
the reference, over decode, prefill with context, sliding windows and split-KV."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from kernels import cpu_ops, reference
from kernels import triton as triton_ops
from worker_svc.attention.prefill_route import sdpa_takes

SCALE = 0.3
CAP = 2.0  # scores of q, k ~ N(0, 1) at head_dim 16-64 times 0.3 spread over several units: the cap bites
BLOCK = 16


def _cache(num_blocks, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, kv_heads, BLOCK, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def _batch(query_lens, context_lens, num_blocks, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // BLOCK) for c in context_lens)
    tables = torch.randperm(num_blocks, generator=g)[: len(context_lens) * width].view(len(context_lens), width)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tables.to(torch.int32), cu, torch.tensor(context_lens, dtype=torch.int32)


def _query(rows, heads, head_dim, dtype, seed=1):
    return torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _capped_and_uncapped(op, *args, window=0):
    """The op with the cap, after checking the cap changes its result (else a test of
    the cap could not fail)."""
    capped = op(*args, SCALE, window, scales=None, softcap=CAP)
    assert not torch.allclose(capped.float(), op(*args, SCALE, window, scales=None).float(), atol=1e-2)
    return capped


@pytest.mark.parametrize("window", [0, 5])
def test_the_reference_caps_scores_as_transformers_gemma2_eager_attention(window):
    # One fresh sequence of 11 tokens, 4 query heads over 2 KV heads: transformers'
    # eager attention (the only one of its paths that caps) with the same causal mask.
    num_tokens, heads, kv_heads, head_dim = 11, 4, 2, 16
    query = _query(num_tokens, heads, head_dim, torch.float32)
    k_cache, v_cache = _cache(4, kv_heads, head_dim, torch.float32)
    tables, cu, ctx = _batch([num_tokens], [num_tokens], 4)
    ours = _capped_and_uncapped(
        reference.paged_prefill_attention, query, k_cache, v_cache, tables, cu, ctx, window=window
    )

    keys = reference.gather_context(k_cache, tables)[:, :, :num_tokens]
    values = reference.gather_context(v_cache, tables)[:, :, :num_tokens]
    pos = torch.arange(num_tokens)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(num_tokens, num_tokens).masked_fill(~visible, -torch.inf)[None, None]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, head_dim=head_dim)
    theirs, _ = eager_attention_forward(
        module, query.transpose(0, 1)[None], keys, values, mask, scaling=SCALE, softcap=CAP
    )
    torch.testing.assert_close(ours, theirs[0], atol=1e-6, rtol=1e-6)


def test_decode_and_contiguous_reference_ops_cap_as_prefill_does():
    # The last row of a prefill is the decode of the same context.
    k_cache, v_cache = _cache(8, 2, 16, torch.float32)
    tables, cu, ctx = _batch([20], [20], 8)
    query = _query(20, 4, 16, torch.float32)
    prefill = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, 7, softcap=CAP)
    decode = reference.paged_decode_attention(query[-1:], k_cache, v_cache, tables, ctx, SCALE, 7, softcap=CAP)
    torch.testing.assert_close(decode, prefill[-1:], atol=1e-6, rtol=1e-6)


def test_fresh_chunks_of_a_capped_model_never_take_the_uncapped_sdpa_route():
    assert sdpa_takes(torch.float32, torch.float32, 0, 32)
    assert not sdpa_takes(torch.float32, torch.float32, 0, 32, softcap=CAP)


CPU_CASES = [
    # (dtype, head_dim, group): fp32/bf16; head_dim 64 takes the lanes tile in prefill,
    # 24 the row-at-a-time path; a GQA group of 4
    (torch.float32, 64, 4),
    (torch.float32, 24, 2),
    (torch.bfloat16, 64, 4),
]


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")
@pytest.mark.parametrize(("dtype", "head_dim", "group"), CPU_CASES, ids=["fp32-d64", "fp32-d24", "bf16-d64"])
@pytest.mark.parametrize("window", [0, 9])
def test_the_cpu_kernel_caps_as_the_reference(dtype, head_dim, group, window):
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    k_cache, v_cache = _cache(40, 2, head_dim, dtype)
    # Prefill: a fresh prompt, a chunk after 37 cached tokens, a single row.
    tables, cu, ctx = _batch([30, 12, 1], [30, 49, 17], 40)
    query = _query(43, 2 * group, head_dim, dtype)
    args = (query, k_cache, v_cache, tables, cu, ctx)
    got = _capped_and_uncapped(cpu_ops.paged_prefill_attention, *args, window=window)
    want = reference.paged_prefill_attention(*args, SCALE, window, softcap=CAP)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    decode_args = (query[:3], k_cache, v_cache, tables, ctx)
    got = _capped_and_uncapped(cpu_ops.paged_decode_attention, *decode_args, window=window)
    want = reference.paged_decode_attention(*decode_args, SCALE, window, softcap=CAP)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")
def test_the_cpu_kernel_refuses_a_negative_cap():
    k_cache, v_cache = _cache(4, 1, 16, torch.float32)
    tables, _, ctx = _batch([1], [5], 4)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        cpu_ops.paged_decode_attention(
            _query(1, 1, 16, torch.float32), k_cache, v_cache, tables, ctx, SCALE, softcap=-1.0
        )


TRITON_DEVICE = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")


@pytest.mark.parametrize("window", [0, 9])
def test_the_triton_kernels_cap_as_the_reference(window):
    k_cache, v_cache = (t.to(TRITON_DEVICE) for t in _cache(24, 2, 16, torch.float32))
    tables, cu, ctx = (t.to(TRITON_DEVICE) for t in _batch([20, 7], [20, 40], 24))
    query = _query(27, 8, 16, torch.float32).to(TRITON_DEVICE)
    args = (query, k_cache, v_cache, tables, cu, ctx)
    got = _capped_and_uncapped(triton_ops.paged_prefill_attention, *args, window=window)
    want = reference.paged_prefill_attention(*args, SCALE, window, softcap=CAP)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    decode_args = (query[:2], k_cache, v_cache, tables, ctx)
    want = reference.paged_decode_attention(*decode_args, SCALE, window, softcap=CAP)
    got = _capped_and_uncapped(triton_ops.paged_decode_attention, *decode_args, window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    split = triton_ops.split_kv_decode_attention(*decode_args, SCALE, window, num_splits=3, softcap=CAP)
    torch.testing.assert_close(split, want, atol=1e-5, rtol=1e-5)
