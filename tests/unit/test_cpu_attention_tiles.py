"""The C++ CPU attention's decode-row tiles (paged_attention_cpu.cpp: score_tile /
pv_tile, head_dim 64 and 128) against the torch reference, the oracle: GQA ratios whose
query vectors split into the kernel's runs of three (1, 3, 4, 8), block sizes where a
block holds no 4-key tile, half a vector or several, contexts off the block edges, the
fp32, bf16 and fp16 caches the kernel reads in place and the staged fp8 / int8 ones,
query rows that stay row-wise (M > 1 at one query head per KV head), sliding windows
and the score cap."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, quant, reference
from tests.helpers.attention_caches import make_cache

SCALE = 0.3
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
CONTEXTS = [1, 3, 4, 5, 15, 16, 17, 33, 100, 129]  # inside a first tile, on and off block and tile edges

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")


def _tables(context_lens, num_blocks, block_size, seed=0):
    """Random non-overlapping block tables, one padding column."""
    width = max(-(-c // block_size) for c in context_lens) + 1
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[: len(context_lens) * width]
    return perm.view(len(context_lens), width).to(torch.int32), torch.tensor(context_lens, dtype=torch.int32)


def _query(rows, heads, head_dim, dtype, seed=1):
    return torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_close(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ATOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _blocks_for(block_size):
    """Enough blocks for _tables' non-overlapping tables of CONTEXTS."""
    return len(CONTEXTS) * (max(-(-c // block_size) for c in CONTEXTS) + 1)


@pytest.mark.parametrize("block_size", [1, 4, 8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_decode_tiles_match_the_reference(group, head_dim, block_size):
    kv_heads = 2
    blocks = _blocks_for(block_size)
    k_cache, v_cache, _ = make_cache(blocks, kv_heads, head_dim, torch.float32, block_size=block_size)
    tables, ctx = _tables(CONTEXTS, blocks, block_size)
    query = _query(len(CONTEXTS), kv_heads * group, head_dim, torch.float32)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))


CACHE_DTYPES = [
    (torch.bfloat16, torch.bfloat16),  # read in place, widened by a shift
    (torch.float32, torch.bfloat16),  # in place too: bf16 is exact in fp32
    (torch.bfloat16, torch.float32),  # staged: rounded to bf16 first, as the reference
    (torch.float16, torch.float16),  # in place: widened by vcvtph2ps
    (torch.float32, torch.float16),  # in place too: fp16 is exact in fp32
    (torch.float32, quant.FP8_DTYPE),
    (torch.bfloat16, torch.int8),
]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "dtype,cache_dtype", CACHE_DTYPES, ids=[f"q{q}-kv{c}".replace("torch.", "") for q, c in CACHE_DTYPES]
)
def test_decode_tiles_for_every_cache_dtype(dtype, cache_dtype, block_size):
    blocks = _blocks_for(block_size)
    k_cache, v_cache, scales = make_cache(blocks, 3, 64, cache_dtype, block_size=block_size)
    tables, ctx = _tables(CONTEXTS, blocks, block_size)
    query = _query(len(CONTEXTS), 9, 64, dtype)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, **scales)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, **scales))


@pytest.mark.parametrize("window", [0, 3, 16, 21])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("group", [1, 3])
def test_row_wise_chunks_windows_and_cap(group, softcap, window):
    # Chunks of 1-3 rows at one query head per KV head stay row-wise (fewer query
    # vectors than half a vector of lanes); at group 3 the 1-row chunks do.
    query_lens, context_lens = [1, 2, 3, 1, 3], [1, 18, 40, 77, 130]
    blocks = 64
    k_cache, v_cache, _ = make_cache(blocks, 2, 64, torch.float32, block_size=16)
    width = max(-(-c // 16) for c in context_lens) + 1
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(5))[: len(context_lens) * width]
    tables = perm.view(len(context_lens), width).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    query = _query(sum(query_lens), 2 * group, 64, torch.float32)
    args = (query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
    out = cpu_ops.paged_prefill_attention(*args, softcap=softcap)
    _assert_close(out, reference.paged_prefill_attention(*args, softcap=softcap))


# A call with fewer than 12 (sequence, KV head) pairs of decode rows cuts each context of
# at least two segments' keys (128 each, whole blocks) into segments attended apart and
# merged (paged_attention_cpu.cpp's work_items / merge_splits): these contexts are cut
# into 2-4 segments (one block of 256 keys is one segment), next to rows too short to cut.
SPLIT_CONTEXTS = [[1000], [129, 700], [300, 5, 1031]]


@pytest.mark.parametrize("block_size", [1, 16, 32, 256])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("contexts", SPLIT_CONTEXTS, ids=["1-seq", "2-seqs", "3-seqs"])
def test_a_few_decode_rows_attend_their_contexts_in_segments(contexts, head_dim, block_size):
    kv_heads, group = 3, 3
    blocks = len(contexts) * (max(-(-c // block_size) for c in contexts) + 1)
    k_cache, v_cache, _ = make_cache(blocks, kv_heads, head_dim, torch.float32, block_size=block_size)
    tables, ctx = _tables(contexts, blocks, block_size)
    query = _query(len(contexts), kv_heads * group, head_dim, torch.float32)
    out = cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))


@pytest.mark.parametrize(
    "dtype,cache_dtype", CACHE_DTYPES, ids=[f"q{q}-kv{c}".replace("torch.", "") for q, c in CACHE_DTYPES]
)
@pytest.mark.parametrize("window,softcap", [(0, 2.0), (200, 0.0), (700, 2.0)])
def test_segments_take_every_cache_dtype_window_and_cap(dtype, cache_dtype, window, softcap):
    contexts = [300, 5, 1031]
    blocks = len(contexts) * (max(-(-c // 16) for c in contexts) + 1)
    k_cache, v_cache, scales = make_cache(blocks, 2, 64, cache_dtype, block_size=16)
    tables, ctx = _tables(contexts, blocks, 16)
    query = _query(len(contexts), 6, 64, dtype)
    args = (query, k_cache, v_cache, tables, ctx, SCALE, window)
    out = cpu_ops.paged_decode_attention(*args, softcap=softcap, **scales)
    _assert_close(out, reference.paged_decode_attention(*args, softcap=softcap, **scales))


def test_segments_give_the_same_bits_on_any_number_of_threads():
    """The cut depends on the call alone: one torch thread with the work pool, without
    it, and two OpenMP threads (which also group a call's KV heads differently)."""
    k_cache, v_cache, _ = make_cache(80, 3, 64, torch.float32, block_size=16)
    tables, ctx = _tables([1000], 80, 16)
    query = _query(1, 9, 64, torch.float32)
    outs = []
    threads = torch.get_num_threads()
    try:
        for torch_threads, pool in ((1, True), (1, False), (2, False)):
            torch.set_num_threads(torch_threads)
            was = torch.ops.pagedserve_cpu.work_pool_enable(pool)
            try:
                outs.append(cpu_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE))
            finally:
                torch.ops.pagedserve_cpu.work_pool_enable(was)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
