"""Triton kernels (kernels/triton/) against the torch reference ops.

Without a GPU they run under the Triton interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; the
setdefault below covers running this file on its own). Each interpreter launch
costs ~0.1 s, so shapes are small and parameters few; with CUDA the same tests
run the compiled kernels.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels import (
    reference,
)
from kernels import triton as triton_ops
from tests.helpers.sweeps import sweep

DEVICE = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")
ATOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SCALE = 0.3  # deliberately not head_dim ** -0.5


def _kv_cache(num_blocks, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=g).to(DEVICE, dtype)
    v = torch.randn(shape, generator=g).to(DEVICE, dtype)
    return k, v


def _batch(query_lens, context_lens, num_blocks, block_size=16, seed=0, pool_offset=0):
    """Random non-contiguous, non-overlapping block tables (padding entries point at
    other random blocks, as the reference allows), cu_query_lens and context_lens."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    perm = torch.randperm(num_blocks - pool_offset, generator=g)[: len(context_lens) * max_blocks] + pool_offset
    tables = perm.view(len(context_lens), max_blocks).to(torch.int32)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return tables.to(DEVICE), cu.to(DEVICE), ctx.to(DEVICE)


def _query(num_tokens, num_heads, head_dim, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, num_heads, head_dim, generator=g).to(DEVICE, dtype)


def _assert_close(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


# --------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)],
)
def test_write_kv_matches_reference(dtype, cache_dtype):
    num_tokens, kv_heads, head_dim = 21, 2, 64
    # The caches are views inside bigger buffers, so that a skipped slot written
    # anyway (slot -1 lands just before the view) shows up as a changed buffer.
    k_buf, v_buf = _kv_cache(42, kv_heads, head_dim, cache_dtype)
    k_cache, v_cache = k_buf[1:41], v_buf[1:41]
    # key/value as the model hands them over: non-contiguous views of one qkv row.
    qkv = _query(num_tokens, 3 * kv_heads, head_dim, dtype)
    key, value = qkv[:, :kv_heads], qkv[:, kv_heads : 2 * kv_heads]
    assert not key.is_contiguous()
    slots = torch.randperm(40 * 16)[:num_tokens]
    slots[[0, 7, 20]] = -1  # skipped: e.g. a prefix-cache hit whose KV is already there
    slots = slots.to(DEVICE)
    expected = (k_buf.clone(), v_buf.clone())
    reference.write_kv(key, value, expected[0][1:41], expected[1][1:41], slots)
    triton_ops.write_kv(key, value, k_cache, v_cache, slots)
    if dtype == cache_dtype or not triton_ops.interpreter_enabled():
        assert torch.equal(k_buf, expected[0]) and torch.equal(v_buf, expected[1])
    else:
        # The interpreter rounds fp32 -> bf16 toward zero (torch and compiled Triton
        # round to nearest even): allow one bf16 ulp.
        for got, want in zip((k_buf, v_buf), expected):
            torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


# --------------------------------------------------------------------------- decode

DECODE_CONTEXTS = [1, 15, 16, 17, 100]  # one token, partial block, block edges, several blocks


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 16), (4, 1, 64), (5, 1, 24)], ids=["mha", "gqa", "mqa", "mqa5-d24"]
)
def test_decode_head_configs(q_heads, kv_heads, head_dim):
    k_cache, v_cache = _kv_cache(64, kv_heads, head_dim, torch.float32)
    tables, _, ctx = _batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, 64)
    query = _query(len(DECODE_CONTEXTS), q_heads, head_dim, torch.float32)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE), torch.float32)


@pytest.mark.parametrize("window", [8, 16, 33])
def test_decode_sliding_window(window):
    # Contexts around the window edge: shorter than, equal to, one past it, and long.
    contexts = [window - 1, window, window + 1, 100]
    k_cache, v_cache = _kv_cache(64, 2, 16, torch.float32)
    tables, _, ctx = _batch([1] * len(contexts), contexts, 64)
    query = _query(len(contexts), 8, 16, torch.float32)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window)
    _assert_close(out, expected, torch.float32)


LOW_PRECISION = [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("dtype,cache_dtype", LOW_PRECISION, ids=["fp16", "bf16", "bf16-fp32cache"])
def test_decode_low_precision(dtype, cache_dtype):
    k_cache, v_cache = _kv_cache(64, 2, 64, cache_dtype)
    tables, _, ctx = _batch([1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS, 64)
    query = _query(len(DECODE_CONTEXTS), 8, 64, dtype)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, 33)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, 33), dtype)


def test_decode_large_pool_and_strided_query():
    """Tables drawn from the top of a 32,768-block pool (block * stride must not
    overflow int32 on big caches) and a query that is a strided view."""
    num_blocks = 32768
    k_cache, v_cache = _kv_cache(num_blocks, 1, 16, torch.float32)
    contexts = [33, 1, 64]
    tables, _, ctx = _batch([1] * 3, contexts, num_blocks, pool_offset=num_blocks - 64)
    query = _query(3, 4, 32, torch.float32)[:, :, ::2]
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE), torch.float32)


# --------------------------------------------------------------------------- split-KV decode


@pytest.mark.parametrize(
    "num_seqs,kv_heads,max_context,sms,expected",
    [
        (64, 8, 4096, 132, 1),  # 512 programs: ~4 per SM already
        (16, 8, 4096, 132, 4),  # 128 programs: one per SM
        (17, 8, 4096, 132, 2),  # 528 // 136 = 3 -> the power of two below
        (1, 8, 32768, 132, 64),  # 66 wanted, capped at MAX_SPLITS
        (1, 8, 4096, 132, 16),  # 4096 / 256: no partition under MIN_SPLIT_TOKENS
        (8, 8, 1024, 132, 4),
        (2, 8, 32768, 132, 32),  # 33 wanted -> the power of two below
        (1, 8, 200, 132, 1),  # shorter than one partition
        (1, 2, 32768, 0, 1),  # no GPU (num_sms 0): never split
        (0, 8, 4096, 132, 1),
    ],
)
def test_num_kv_splits(num_seqs, kv_heads, max_context, sms, expected):
    assert triton_ops.num_kv_splits(num_seqs, kv_heads, max_context, sms) == expected


def test_num_kv_splits_bounds():
    for seqs in (1, 3, 7, 33):
        for ctx in (1, 255, 256, 1000, 70000):
            n = triton_ops.num_kv_splits(seqs, 4, ctx, 132)
            assert n & (n - 1) == 0 and 1 <= n <= triton_ops.MAX_SPLITS
            assert n == 1 or ctx // n >= triton_ops.MIN_SPLIT_TOKENS


# Very different lengths in one batch, none a multiple of the 64-position KV tile
# nor of a partition: 1 token, a partial tile, a tile and a bit, several tiles.
SPLIT_CONTEXTS = [1, 50, 65, 300, 129]


def _split_case(contexts, q_heads, kv_heads, head_dim, dtype=torch.float32, num_blocks=128):
    k_cache, v_cache = _kv_cache(num_blocks, kv_heads, head_dim, dtype)
    tables, _, ctx = _batch([1] * len(contexts), contexts, num_blocks)
    return _query(len(contexts), q_heads, head_dim, dtype), k_cache, v_cache, tables, ctx


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_split_kv_decode_matches_reference(num_splits):
    """Forced partitions: 1 (the single-pass kernel), 2, an odd count and more
    partitions than a short sequence has tiles (empty ones must weigh nothing)."""
    query, k_cache, v_cache, tables, ctx = _split_case(SPLIT_CONTEXTS, 8, 2, 32)
    out = triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, num_splits=num_splits)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [8, 70])
def test_split_kv_decode_sliding_window(window):
    # The partitions divide the tiles inside the window, whatever their count.
    query, k_cache, v_cache, tables, ctx = _split_case(SPLIT_CONTEXTS, 4, 1, 16)
    out = triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window, num_splits=4)
    expected = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window)
    _assert_close(out, expected, torch.float32)


def test_split_kv_decode_low_precision_and_padding_rows():
    """bf16 query and cache; and a sequence with context 0 (what a padding row of a
    captured graph could be) gets 0, as the single-pass kernel gives it."""
    query, k_cache, v_cache, tables, ctx = _split_case([300, 17, 1], 8, 2, 64, torch.bfloat16)
    out = triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, num_splits=4)
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE), torch.bfloat16)
    ctx[2] = 0
    for splits in (1, 4):
        out = triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, num_splits=splits)
        assert torch.equal(out[2], torch.zeros_like(out[2])), splits


@pytest.mark.parametrize("window", [0, 8])
def test_split_kv_never_reads_unseen_slots(window):
    contexts = [100, 45, 16]
    k_clean, v_clean = _kv_cache(64, 2, 16, torch.float32)
    tables, cu, ctx = _batch([1] * 3, contexts, 64)
    k_cache, v_cache = (_poison_invisible(c, tables, cu, ctx, window) for c in (k_clean, v_clean))
    query = _query(3, 8, 16, torch.float32)
    out = triton_ops.split_kv_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window, num_splits=2)
    assert torch.isfinite(out).all()
    expected = reference.paged_decode_attention(query, k_clean, v_clean, tables, ctx, SCALE, window)
    _assert_close(out, expected, torch.float32)


@pytest.mark.skipif(not triton_ops.interpreter_enabled(), reason="reads the interpreter's program ids")
def test_each_sequence_takes_the_partitions_its_own_length_fills(monkeypatch):
    """Issue 27, fault 7: the grid's partition count comes from the table's reach (a
    captured graph's tables are as wide as max_model_len), but a sequence splits
    only as far as its own context makes partitions of min_split_tokens: a long and
    a short sequence under the same 8 partitions of >= 128 positions, the long one
    (1000 positions) works in all 8, the short one (100) in one; the result is the
    reference's either way."""
    from triton.runtime import interpreter

    working: dict[int, set[int]] = {}
    real_dot = interpreter.InterpreterBuilder.create_dot

    def dot(self, *args):
        seq, _, split = self.grid_idx
        working.setdefault(seq, set()).add(split)
        return real_dot(self, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", dot)
    query, k_cache, v_cache, tables, ctx = _split_case([1000, 100], 4, 1, 16)
    out = triton_ops.split_kv_decode_attention(
        query, k_cache, v_cache, tables, ctx, SCALE, num_splits=8, min_split_tokens=128
    )
    assert working == {0: set(range(8)), 1: {0}}
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE), torch.float32)


def test_decode_chooses_splits_from_the_sm_count(monkeypatch):
    """paged_decode_attention (and the contiguous layout through it) asks
    num_kv_splits with the table's reach as the longest context."""
    asked = []
    real = triton_ops.num_kv_splits
    monkeypatch.setattr(triton_ops.launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(triton_ops.launch, "num_kv_splits", lambda *args: asked.append(args) or real(*args))
    query, k_cache, v_cache, tables, ctx = _split_case([300, 1000], 4, 1, 16)
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE)
    assert asked == [(2, 1, tables.shape[1] * 16, 132)] and real(*asked[0]) == 2
    _assert_close(out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE), torch.float32)


# --------------------------------------------------------------------------- prefill

PREFILL_CASES = {
    # (new tokens, context) per sequence
    "no-cache": [(17, 17), (40, 40), (1, 1)],
    "chunked": [(16, 48), (5, 18), (33, 100)],  # context > new tokens: earlier chunks / prefix-cache hits
    "mixed": [(1, 1328), (5, 18), (129, 463)],
    "all-decode": [(1, 1), (1, 16), (1, 17), (1, 100)],
}


PREFILL_HEADS = {"mha-d64": (4, 4, 64), "gqa-d16": (8, 2, 16), "mqa5-d80": (5, 1, 80)}
# make test keeps a diagonal: every batch shape once and every head layout (MHA, GQA,
# MQA with an odd group and a head_dim that is no power of two) once; each kernel
# branch those select runs. The rest of the product repeats them (make test-slow).
PREFILL_KEEP = {("no-cache", "mha-d64"), ("chunked", "gqa-d16"), ("mixed", "mqa5-d80"), ("all-decode", "gqa-d16")}
PREFILL_SWEEP = [(case, heads) for case in PREFILL_CASES for heads in PREFILL_HEADS]


@pytest.mark.parametrize("case,heads", sweep(PREFILL_SWEEP, PREFILL_KEEP, ids=[f"{c}-{h}" for c, h in PREFILL_SWEEP]))
def test_prefill_matches_reference(case, heads):
    q_heads, kv_heads, head_dim = PREFILL_HEADS[heads]
    query_lens, contexts = zip(*PREFILL_CASES[case])
    k_cache, v_cache = _kv_cache(256, kv_heads, head_dim, torch.float32)
    tables, cu, ctx = _batch(query_lens, contexts, 256)
    query = _query(sum(query_lens), q_heads, head_dim, torch.float32)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE)
    _assert_close(out, expected, torch.float32)


def test_prefill_large_pool():
    """Tables drawn from all over a 32,768-block pool (block * stride must be int64
    on big caches), the issue's mix of lengths, sliding window across the chunk."""
    query_lens, contexts = zip(*PREFILL_CASES["mixed"])
    k_cache, v_cache = _kv_cache(32768, 2, 16, torch.float32)
    tables, cu, ctx = _batch(query_lens, contexts, 32768)
    query = _query(sum(query_lens), 8, 16, torch.float32)
    for window in (0, 33):
        out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
        expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
        _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("window", [8, 33])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim", [(4, 1, 64), (2, 2, 16)], ids=["mqa-d64", "mha-d16"])
def test_prefill_sliding_window(window, q_heads, kv_heads, head_dim):
    # With MHA a query tile holds 64 tokens, so its last rows see nothing in the
    # first KV tile visited (their window starts later): the online softmax must
    # not turn that into NaN.
    query_lens, contexts = zip(*PREFILL_CASES["mixed"])
    k_cache, v_cache = _kv_cache(256, kv_heads, head_dim, torch.float32)
    tables, cu, ctx = _batch(query_lens, contexts, 256)
    query = _query(sum(query_lens), q_heads, head_dim, torch.float32)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
    expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
    _assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype,cache_dtype", LOW_PRECISION, ids=["fp16", "bf16", "bf16-fp32cache"])
def test_prefill_low_precision(dtype, cache_dtype):
    query_lens, contexts = zip(*PREFILL_CASES["chunked"])
    k_cache, v_cache = _kv_cache(64, 2, 64, cache_dtype)
    tables, cu, ctx = _batch(query_lens, contexts, 64)
    query = _query(sum(query_lens), 8, 64, dtype)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, 8)
    _assert_close(out, reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, 8), dtype)


@pytest.mark.parametrize("block_size", [8, 32])
def test_prefill_other_block_sizes(block_size):
    query_lens, contexts = (9, 1, 20), (40, 1, 20)
    k_cache, v_cache = _kv_cache(32, 2, 16, torch.float32, block_size=block_size)
    tables, cu, ctx = _batch(query_lens, contexts, 32, block_size=block_size)
    query = _query(sum(query_lens), 4, 16, torch.float32)
    for window in (0, 9):
        out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
        expected = reference.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
        _assert_close(out, expected, torch.float32)


# --------------------------------------------------------------------------- nothing outside is read


def _poison_invisible(cache, tables, cu, ctx, window):
    """NaN into every cache slot that no query of the batch may see: positions
    before the window of the sequence's first new token, past its context (the
    empty tail of the last block), and every block not in a table."""
    block_size = cache.shape[2]
    poisoned = torch.full_like(cache, float("nan"))
    for s in range(tables.shape[0]):
        first_new = int(ctx[s]) - int(cu[s + 1] - cu[s])
        lo = max(0, first_new - window + 1) if window else 0
        for pos in range(lo, int(ctx[s])):
            block, offset = int(tables[s, pos // block_size]), pos % block_size
            poisoned[block, :, offset] = cache[block, :, offset]
    return poisoned


@pytest.mark.parametrize("window", [0, 8])
def test_unseen_slots_are_never_read(window):
    query_lens, contexts = (1, 3, 20, 1), (100, 50, 45, 16)
    k_clean, v_clean = _kv_cache(64, 2, 16, torch.float32)
    tables, cu, ctx = _batch(query_lens, contexts, 64)
    # Table padding entries point at one more block the sequence does not own.
    tables[1, 4:] = tables[0, -1]
    k_cache, v_cache = (_poison_invisible(c, tables, cu, ctx, window) for c in (k_clean, v_clean))
    query = _query(sum(query_lens), 8, 16, torch.float32)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, window)
    assert torch.isfinite(out).all()
    expected = reference.paged_prefill_attention(query, k_clean, v_clean, tables, cu, ctx, SCALE, window)
    _assert_close(out, expected, torch.float32)
    decode = torch.tensor([0, 3], device=DEVICE)  # the one-token sequences through the decode kernel
    out = triton_ops.paged_decode_attention(
        query[cu[decode]], k_cache, v_cache, tables[decode], ctx[decode], SCALE, window
    )
    assert torch.isfinite(out).all()
    _assert_close(out, expected[cu[decode]], torch.float32)


@pytest.mark.skipif(not triton_ops.interpreter_enabled(), reason="counts tl.dot calls in the interpreter")
def test_window_skips_blocks_outside(monkeypatch):
    """KV tiles wholly before the window are not visited at all (the loop starts at
    the BLOCK_N-position tile holding the window's first position), not loaded and
    masked: count the kernel's tl.dot calls, two per KV tile visited."""
    from triton.runtime import interpreter

    dots = []
    real_dot = interpreter.InterpreterBuilder.create_dot
    monkeypatch.setattr(
        interpreter.InterpreterBuilder, "create_dot", lambda self, *args: dots.append(1) or real_dot(self, *args)
    )

    def tiles_of(decode: bool) -> tuple[int, int]:
        meta, _ = triton_ops.attention_launch(4, 1, 16, 16, torch.float32, torch.float32, decode, True)
        return int(meta["BLOCK_N"]), int(meta["BLOCK_Q"])

    def visited(first: int, end: int, block_n: int) -> int:
        """KV tiles the loop visits for the positions [first, end)."""
        return -(-end // block_n) - first // block_n

    k_cache, v_cache = _kv_cache(64, 1, 16, torch.float32)
    tables, cu, ctx = _batch([1], [1000], 64)
    query = _query(1, 4, 16, torch.float32)
    block_n, _ = tiles_of(decode=True)
    # full: all 1000 positions; window W sees 1000 - W .. 999
    for window in (0, 8, 300):
        dots.clear()
        out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window)
        first = 1000 - window if window else 0
        assert len(dots) == 2 * visited(first, 1000, block_n), (window, len(dots))
        _assert_close(
            out, reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, SCALE, window), torch.float32
        )
    assert visited(992, 1000, block_n) == 1 < visited(0, 1000, block_n)
    # prefill: 10 new tokens at positions 990..999, window 8. Query tiles sit at
    # multiples of BLOCK_Q positions; each sees from its first position - 7 to its last.
    dots.clear()
    block_n, block_q = tiles_of(decode=False)
    cu = torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)
    query = _query(10, 4, 16, torch.float32)
    triton_ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, SCALE, 8)
    starts = range(990 // block_q * block_q, 1000, block_q)
    expected = sum(visited(max(s, 990) - 7, min(1000, s + block_q), block_n) for s in starts)
    assert len(dots) == 2 * expected and expected < visited(983, 1000, 1) // 2


# --------------------------------------------------------------------------- masked loads


def test_every_masked_load_says_what_masked_lanes_hold():
    """A masked tl.load without `other=` leaves masked lanes undefined on the GPU
    (the interpreter zero-fills them, so no CPU run can show it): the split-KV
    merge read its partials that way, right only while the lanes happened to be
    zero (issue 27, fault 11). Every masked load in the kernels names `other=`."""
    import ast
    from pathlib import Path

    masked: list[tuple[str, ast.Call]] = []
    for path in sorted(Path(triton_ops.__file__).parent.glob("*.py")):  # every module of the op set
        masked += [
            (path.name, node)
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "tl"
            and any(k.arg == "mask" for k in node.keywords)
        ]
    assert len(masked) >= 10, "the walk found too few masked loads"
    bare = [f"{name}:{call.lineno}" for name, call in masked if not any(k.arg == "other" for k in call.keywords)]
    assert not bare, f"kernels/triton/ {bare}: masked tl.load without other="


# --------------------------------------------------------------------------- compiled for CUDA

# Run in a fresh process without the interpreter: compile (through ptxas, which the
# triton wheel bundles) for sm_90 and sm_80 without a GPU, so that what only the
# compiler checks (tl.dot shapes, dtypes, control flow) is checked on CPU-only
# machines too.
_COMPILE_SCRIPT = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import triton as T
assert not T.interpreter_enabled()
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

def compile(fn, pointers, constexprs, arch, options=None):
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32), options=options)

f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
for arch, q, c, heads, kv_heads, head_dim, block_size, decode, sliding, split in [
    (90, bf16, bf16, 8, 2, 128, 16, True, False, False), (90, f16, f16, 5, 1, 80, 16, False, True, False),
    (90, bf16, f32, 4, 4, 64, 32, False, False, False), (80, f32, f32, 8, 1, 128, 16, False, True, False),
    (80, f16, f16, 16, 2, 64, 8, True, True, False), (90, bf16, bf16, 32, 8, 64, 16, True, True, True),
    (80, f32, f32, 4, 1, 128, 16, True, False, True),
]:
    capability = (arch // 10, arch % 10)
    meta, options = T.attention_launch(heads, kv_heads, head_dim, block_size, q, c, decode, sliding, capability, False,
                                       split)
    io, cache = "*" + NAME[q], "*" + NAME[c]
    part = "*fp32" if split else io
    compile(T.attention_kernel.paged_attention_kernel, dict(out_ptr=io, q_ptr=io, k_cache_ptr=cache, v_cache_ptr=cache,
            block_tables_ptr="*i32", context_lens_ptr="*i32", cu_query_lens_ptr="*i32", part_out_ptr=part,
            part_max_ptr=part, part_sum_ptr=part), meta, arch, options)
for arch, io, splits in ((90, "*bf16", 64), (80, "*fp32", 2)):
    compile(T.attention_kernel.merge_splits_kernel, dict(out_ptr=io, part_out_ptr="*fp32", part_max_ptr="*fp32",
            part_sum_ptr="*fp32"), dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_S=splits), arch)
compile(T.kv_write._write_kv_kernel, dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr="*bf16", v_cache_ptr="*bf16",
        slot_ptr="*i64"), dict(HEAD_DIM=64, BLOCK_SIZE=16, NUM_KV_HEADS=2, BLOCK_T=16, BLOCK_HD=128), 90)
print("compiled")
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the other tests already run the compiled kernels")
def test_kernels_compile_for_cuda():
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT],
        cwd=Path(__file__).parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


# --------------------------------------------------------------------------- the whole model


# Under the interpreter each case is ~90 s of steps on 2 cores: make test keeps the
# one-pass decode; split-KV repeats the same model path with the decode the split-KV
# tests above check kernel by kernel (windows, low precision, the SM count's choice), so
# it is make test-slow's. Compiled on a GPU (make gpu-check) both run.
WORKER_SPLIT_KV = sweep(
    [False, True], keep=[False] if triton_ops.interpreter_enabled() else [False, True], ids=["one-pass", "split-kv"]
)


@pytest.mark.parametrize("split_kv", WORKER_SPLIT_KV)
def test_worker_triton_backend_matches_torch(split_kv, monkeypatch):
    """Gemma3 (sliding-window layers, GQA) through the worker: the Triton backend and
    the torch backend give the same logits on a prefill, a mixed chunk + decode
    step and a decode step. split-kv: the decodes as a 132-SM GPU would run them,
    their 64-position contexts cut into 16-token partitions."""
    if split_kv:
        monkeypatch.setattr(triton_ops.launch, "num_sms", lambda device: 132)
        monkeypatch.setattr(triton_ops.launch, "MIN_SPLIT_TOKENS", 16)
    from tests.helpers.worker_steps import Seq, sampled, step_input
    from tools.tiny_checkpoints import ensure_checkpoint
    from worker_svc.config import WorkerConfig
    from worker_svc.worker import Worker

    model = str(ensure_checkpoint("gemma3"))
    workers = {
        backend: Worker(
            WorkerConfig(model=model, dtype="float32", num_blocks=32, attention_backend=backend, device=str(DEVICE))
        )
        for backend in ("torch", "triton")
    }
    assert workers["triton"].backend == "triton"
    vocab = workers["torch"].info.vocab_size
    prompt_a = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt_b = torch.randint(3, vocab, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    tables = {1: [7, 2, 30, 11], 2: [5, 19, 0, 23]}  # scattered, 64 tokens each

    def seq(seq_id, tokens, start, sample=True):
        table = tables[seq_id]
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return Seq(seq_id, tokens, start, table, slots, sample=sample, return_logits=sample)

    def run(step_id, seqs):
        outs = {name: w.step(step_input(step_id, [], seqs)) for name, w in workers.items()}
        for want, got in zip(sampled(outs["torch"]), sampled(outs["triton"]), strict=True):
            assert want.seq_id == got.seq_id and want.token_id == got.token_id
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        return {s.seq_id: s.token_id for s in sampled(outs["torch"])}

    # Step 1: seq 1 prefills 40 tokens; seq 2 prefills its first chunk of 24 (no sample).
    tokens = run(1, [seq(1, prompt_a, 0), seq(2, prompt_b[:24], 0, sample=False)])
    # Step 2: seq 1 decodes while seq 2 prefills its second chunk over its cached 24.
    tokens = run(2, [seq(1, [tokens[1]], 40), seq(2, prompt_b[24:], 24)])
    # Step 3: both decode.
    run(3, [seq(1, [tokens[1]], 41), seq(2, [tokens[2]], 40)])
