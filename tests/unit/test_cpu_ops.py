"""The C++ CPU attention (kernels/cpu_ops.py) against the torch reference ops, the
oracle: every cache dtype with its scales, MHA/GQA/MQA, sliding windows, ragged
lengths across block edges, prefill with context, both cache layouts, and the
fallback to the reference where the kernel cannot be built."""

from __future__ import annotations

import warnings

import pytest
import torch

from kernels import cpu_build, cpu_ops, quant, reference
from tests.helpers.attention_caches import make_cache

SCALE = 0.3  # deliberately not head_dim ** -0.5
ATOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# (query dtype, cache dtype): the model's dtype with a cache of the same, fp8 or int8
# (and fp32 queries over the narrower caches, as --kv-dtype allows).
DTYPES = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, quant.FP8_DTYPE),
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, quant.FP8_DTYPE),
    (torch.bfloat16, torch.int8),
    (torch.float16, torch.float16),
    (torch.float16, torch.int8),
]
DTYPE_IDS = [f"q{str(q)[6:]}-kv{str(c)[6:]}" for q, c in DTYPES]

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")


def make_batch(query_lens, context_lens, num_blocks, block_size=16, extra_columns=0, seed=0):
    """Random non-overlapping block tables (padding columns point at other random
    blocks, as the reference allows), cu_query_lens and context_lens."""
    g = torch.Generator().manual_seed(seed)
    width = max(-(-c // block_size) for c in context_lens) + extra_columns
    perm = torch.randperm(num_blocks, generator=g)[: len(context_lens) * width]
    tables = perm.view(len(context_lens), width).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return tables, cu, torch.tensor(context_lens, dtype=torch.int32)


def make_query(num_tokens, heads, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, heads, head_dim, generator=g).to(dtype)


def assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ATOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


DECODE_CONTEXTS = [1, 15, 16, 17, 100, 257]  # one token, partial block, block edges, many blocks


@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_matches_reference_for_every_dtype(dtype, cache_dtype):
    k_cache, v_cache, scales = make_cache(128, 2, 64, cache_dtype)
    tables, _, ctx = make_batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, 128, extra_columns=2)
    query = make_query(len(DECODE_CONTEXTS), 6, 64, dtype)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, **scales)
    assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, **scales))


@pytest.mark.parametrize("head_dim", [32, 64], ids=["rows-d32", "lanes-d64"])
@pytest.mark.parametrize("dtype,cache_dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_with_context_matches_reference_for_every_dtype(dtype, cache_dtype, head_dim):
    # Chunks: a whole fresh prompt, chunks after cached context (inside a block, on
    # a block edge, longer than the row tile of 16), and a one-token chunk. At
    # head_dim 64 the tiles of >= 4 rows (x 2 query heads per KV head) take the
    # kernel's lane-wise (matrix-shaped) path, the 1-row chunk the row-wise one.
    query_lens = [20, 5, 16, 37, 1]
    context_lens = [20, 21, 48, 100, 9]
    k_cache, v_cache, scales = make_cache(96, 2, head_dim, cache_dtype)
    tables, cu, ctx = make_batch(query_lens, context_lens, 96, extra_columns=1)
    query = make_query(sum(query_lens), 4, head_dim, dtype)
    out = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales)
    assert_close(out, expected)


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim",
    [(4, 4, 64), (9, 3, 64), (8, 2, 16), (4, 1, 64), (5, 1, 24), (2, 2, 128)],
    ids=["mha", "gqa3-smollm2", "gqa4", "mqa", "mqa5-d24", "d128"],
)
def test_head_layouts(q_heads, kv_heads, head_dim):
    k_cache, v_cache, _ = make_cache(64, kv_heads, head_dim, torch.float32)
    tables, _, ctx = make_batch([1] * len(DECODE_CONTEXTS[:5]), DECODE_CONTEXTS[:5], 64)
    query = make_query(5, q_heads, head_dim, torch.float32)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))
    query_lens, context_lens = [3, 17], [40, 17]
    tables, cu, ctx = make_batch(query_lens, context_lens, 64, seed=2)
    query = make_query(20, q_heads, head_dim, torch.float32)
    out = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE)
    assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE))


@pytest.mark.parametrize("head_dim", [16, 128], ids=["rows-d16", "lanes-d128"])
@pytest.mark.parametrize("window", [1, 8, 16, 33])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
def test_sliding_window(window, cache_dtype, head_dim):
    contexts = [max(1, window - 1), window, window + 1, 100]
    k_cache, v_cache, scales = make_cache(64, 2, head_dim, cache_dtype)
    tables, _, ctx = make_batch([1] * 4, contexts, 64)
    query = make_query(4, 8, head_dim, torch.float32)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window, **scales)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window, **scales)
    assert_close(out, expected)
    query_lens = [max(1, window - 1), 20, 3]
    context_lens = [max(1, window - 1), 70, 100]
    tables, cu, ctx = make_batch(query_lens, context_lens, 64, seed=3)
    query = make_query(sum(query_lens), 8, head_dim, torch.float32)
    out = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window, **scales)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window, **scales)
    assert_close(out, expected)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size):
    k_cache, v_cache, scales = make_cache(256 // block_size * 4, 2, 32, torch.int8, block_size=block_size)
    tables, cu, ctx = make_batch([7, 1, 30], [40, 33, 90], k_cache.shape[0], block_size=block_size)
    query = make_query(38, 4, 32, torch.float32)
    out = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales)
    assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales))


def test_strided_query_and_int64_tables():
    # q as the model hands it over: a view into one fused qkv row.
    k_cache, v_cache, _ = make_cache(32, 2, 16, torch.bfloat16)
    tables, _, ctx = make_batch([1] * 3, [5, 16, 70], 32)
    qkv = make_query(3, 12, 16, torch.bfloat16)
    query = qkv[:, :8]
    assert not query.is_contiguous()
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables.long(), ctx, SCALE)
    assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, quant.FP8_DTYPE])
def test_contiguous_layout(cache_dtype):
    # [max_batch, kv_heads, max_seq_len, d]: each sequence owns one slot.
    k_cache, v_cache, scales = make_cache(4, 2, 32, cache_dtype, block_size=128)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32)
    ctx = torch.tensor([1, 77, 128], dtype=torch.int32)
    query = make_query(3, 4, 32, torch.bfloat16)
    out = cpu_ops.contiguous_decode_attention(query, k_cache, v_cache, slots, ctx, SCALE, **scales)
    assert_close(out, reference.contiguous_decode_attention(query, k_cache, v_cache, slots, ctx, SCALE, **scales))
    cu = torch.tensor([0, 1, 11, 41], dtype=torch.int32)
    query = make_query(41, 4, 32, torch.bfloat16)
    out = cpu_ops.contiguous_prefill_attention(query, k_cache, v_cache, slots, cu, ctx, SCALE, **scales)
    expected = reference.contiguous_prefill_attention(query, k_cache, v_cache, slots, cu, ctx, SCALE, **scales)
    assert_close(out, expected)


def test_long_context_softmax_stays_stable():
    # Large scores over a long context: the online softmax rescales without overflow.
    k_cache, v_cache, _ = make_cache(160, 1, 64, torch.float32)
    k_cache *= 30
    tables, _, ctx = make_batch([1, 1], [1280, 700], 160)
    query = make_query(2, 2, 64, torch.float32) * 4
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    assert torch.isfinite(out).all()
    assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))


def test_bad_input_is_refused_with_the_field_named():
    k_cache, v_cache, scales = make_cache(8, 2, 16, torch.int8)
    tables, _, ctx = make_batch([1], [20], 8)
    query = make_query(1, 4, 16, torch.float32)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    with pytest.raises(RuntimeError, match="block table too narrow"):
        cpu_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, torch.tensor([40], dtype=torch.int32), SCALE, **scales
        )


def test_falls_back_to_the_reference_with_one_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "pagedserve-no-such-g++")
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    cpu_build.load.cache_clear()
    try:
        k_cache, v_cache, _ = make_cache(16, 2, 16, torch.float32)
        tables, _, ctx = make_batch([1, 1], [9, 40], 16)
        query = make_query(2, 4, 16, torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
            second = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == 1 and "pagedserve-no-such-g++: not found" in messages[0] and "reference" in messages[0]
        expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
        assert torch.equal(first, expected) and torch.equal(second, expected)
    finally:
        cpu_build.load.cache_clear()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_long_bf16_chunks_are_as_accurate_as_the_reference(cache_dtype):
    # Over 256-row chunks the bf16 outputs of the kernel and the reference differ by up to
    # ~2 bf16 ulps (each rounds differently); against an fp64 evaluation of the same
    # cache contents the kernel must be no further off than the reference is.
    k_cache, v_cache, scales = make_cache(48, 2, 64, cache_dtype)
    tables, cu, ctx = make_batch([256, 200], [256, 300], 48)
    query = make_query(456, 6, 64, torch.bfloat16)
    ours = cpu_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales).double()
    ref = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, **scales).double()

    # fp64 truth over the values the bf16 reference reads (dequantized, rounded to bf16).
    def seen(cache, scale, zero):
        values = cache if scale is None else quant.dequantize(cache, scale, zero)
        return values.to(torch.bfloat16).double()

    kv = scales.get("scales")
    k_seen = seen(k_cache, kv and kv.k_scale, kv and kv.k_zero)
    v_seen = seen(v_cache, kv and kv.v_scale, kv and kv.v_zero)
    truth = reference.paged_prefill_attention(query.double(), k_seen, v_seen, tables, cu, ctx, SCALE)
    assert (ours - truth).abs().max() <= 1.1 * (ref - truth).abs().max()
