"""The contiguous KV layout on the worker side: its reference attention ops give
the paged ops' results on the same K/V (unquantized, FP8, INT8, sliding window,
GQA), the Triton kernels read it too, and both caches are KVCachePools."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels import reference
from worker_svc.attention.kv_cache import ContiguousKVCache, KVCachePool, PagedKVCache, kv_cache_class

BS = 16
L = 64  # max_seq_len of the contiguous slots
HEADS, KV_HEADS, D = 4, 2, 16
SCALE = 0.3


def _write_both(context_lens, dtype, seed=0):
    """The same K/V written into a contiguous cache (sequence s in slot slots[s]) and a
    paged one (random block tables); returns the caches and the per-sequence indexes."""
    g = torch.Generator().manual_seed(seed)
    n = len(context_lens)
    contiguous = ContiguousKVCache(1, n + 1, KV_HEADS, L, D, dtype, torch.device("cpu"))
    paged = PagedKVCache(1, 4 * L // BS, KV_HEADS, BS, D, dtype, torch.device("cpu"))
    slots = torch.randperm(n + 1, generator=g)[:n]
    blocks = torch.randperm(paged.num_blocks, generator=g)[: n * (L // BS)].view(n, L // BS).to(torch.int32)
    for s, ctx in enumerate(context_lens):
        key = torch.randn(ctx, KV_HEADS, D, generator=g)
        value = torch.randn(ctx, KV_HEADS, D, generator=g)
        pos = torch.arange(ctx)
        contiguous.write(0, key, value, int(slots[s]) * L + pos)
        paged.write(0, key, value, blocks[s, pos // BS].long() * BS + pos % BS)
    return contiguous, paged, slots, blocks


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("window", [0, 7])
def test_contiguous_ops_equal_the_paged_ops(dtype, window):
    context_lens, query_lens = [5, 40, 64, 17], [5, 3, 1, 17]
    contiguous, paged, slots, blocks = _write_both(context_lens, dtype)
    query = torch.randn(sum(query_lens), HEADS, D, generator=torch.Generator().manual_seed(9))
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    k, v = contiguous.layer(0)
    ours = reference.contiguous_prefill_attention(
        query, k, v, slots, cu, ctx, SCALE, window, scales=contiguous.layer_scales(0)
    )
    pk, pv = paged.layer(0)
    scales = paged.layer_scales(0)
    want = reference.paged_prefill_attention(query, pk, pv, blocks, cu, ctx, SCALE, window, scales=scales)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)

    decode_q = torch.randn(len(context_lens), HEADS, D, generator=torch.Generator().manual_seed(3))
    ours = reference.contiguous_decode_attention(
        decode_q, k, v, slots, ctx, SCALE, window, scales=contiguous.layer_scales(0)
    )
    want = reference.paged_decode_attention(decode_q, pk, pv, blocks, ctx, SCALE, window, scales=paged.layer_scales(0))
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-6)


def test_contiguous_reads_only_the_context_of_each_slot():
    # Garbage past a sequence's context (an earlier, longer tenant of the slot) is never seen.
    contiguous, _, slots, _ = _write_both([10], torch.float32)
    k, v = contiguous.layer(0)
    query = torch.randn(1, HEADS, D)
    ctx = torch.tensor([10], dtype=torch.int32)
    before = reference.contiguous_decode_attention(query, k, v, slots, ctx, SCALE)
    k[int(slots[0]), :, 10:] = 1e4
    v[int(slots[0]), :, 10:] = float("nan")
    torch.testing.assert_close(reference.contiguous_decode_attention(query, k, v, slots, ctx, SCALE), before)


def test_triton_kernels_read_the_contiguous_layout():
    from kernels import triton as triton_ops

    if not triton_ops.interpreter_enabled() and not torch.cuda.is_available():
        pytest.skip("no GPU and the Triton interpreter is off")
    device = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")
    context_lens, query_lens = [5, 40, 64], [5, 3, 1]
    contiguous, _, slots, _ = _write_both(context_lens, torch.float32)
    k, v = (t.to(device) for t in contiguous.layer(0))
    slots = slots.to(device)
    query = torch.randn(sum(query_lens), HEADS, D, generator=torch.Generator().manual_seed(9)).to(device)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    for window in (0, 7):
        got = triton_ops.contiguous_prefill_attention(query, k, v, slots, cu, ctx, SCALE, window)
        want = reference.contiguous_prefill_attention(query, k, v, slots, cu, ctx, SCALE, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    decode_q = query[: len(context_lens)].contiguous()
    got = triton_ops.contiguous_decode_attention(decode_q, k, v, slots, ctx, SCALE)
    torch.testing.assert_close(
        got, reference.contiguous_decode_attention(decode_q, k, v, slots, ctx, SCALE), atol=1e-5, rtol=1e-5
    )


def test_both_caches_are_kv_cache_pools_with_the_same_memory_formula():
    cpu = torch.device("cpu")
    contiguous = kv_cache_class("contiguous")(3, 8, 2, 256, 16, torch.bfloat16, cpu)
    paged = kv_cache_class("paged")(3, 8 * 256 // 16, 2, 16, 16, torch.bfloat16, cpu)
    assert isinstance(contiguous, KVCachePool) and isinstance(paged, KVCachePool)
    assert (contiguous.layout, contiguous.num_blocks, contiguous.block_size) == ("contiguous", 8, 256)
    assert contiguous.k.shape == (3, 8, 2, 256, 16)  # [layers, max_batch, kv_heads, max_seq_len, head_dim]
    assert contiguous.total_bytes == paged.total_bytes == 8 * contiguous.block_bytes
    quantized = kv_cache_class("contiguous")(3, 4, 2, 64, 16, torch.int8, cpu)
    assert quantized.total_bytes == 4 * quantized.block_bytes and quantized.scale_block_bytes > 0
    with pytest.raises(ValueError, match="kv layout"):
        kv_cache_class("ring")(1, 1, 1, 16, 16, torch.float32, cpu)


def test_slot_copy_moves_values_and_scales():
    contiguous, _, slots, _ = _write_both([30, 12], torch.int8)
    src, dst = int(slots[0]), ({0, 1, 2} - {int(s) for s in slots}).pop()
    contiguous.copy_blocks([src], [dst])
    for t in contiguous.tensors:
        assert torch.equal(t[:, dst], t[:, src])
