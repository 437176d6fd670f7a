"""A prompt's attention output does not depend on how it was chunked, or on part
of it coming from the prefix cache, with a lossy (FP8/INT8) KV cache.

What makes this hold: every step writes its tokens' K/V into the cache first and
attention reads all of its context back from the cache (worker_svc/attention/),
so a chunk's own tokens are seen quantized-then-dequantized exactly as a later
request that finds them cached sees them. Given the same K/V rows, one chunk,
several chunks and a cached prefix must give bit-identical outputs, on the torch
path and on the Triton path (interpreted on CPU).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels import quant, reference
from kernels import triton as triton_ops
from worker_svc.attention.kv_cache import PagedKVCache

DEVICE = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")
BLOCK, KV_HEADS, Q_HEADS, HEAD_DIM, LENGTH = 16, 2, 4, 32, 45


def _prompt(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [L, q_heads, d], k and v [L, kv_heads, d] of one prompt."""
    gen = torch.Generator().manual_seed(seed)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(LENGTH, heads, HEAD_DIM, generator=gen).to(DEVICE)

    return draw(Q_HEADS), draw(KV_HEADS), draw(KV_HEADS)


def _attend_in_chunks(ops, dtype, prompt, bounds: list[int], prefix_cache=None, window: int = 0):
    """Run the prompt through write + prefill attention chunk by chunk, each chunk's
    rows [bounds[i], bounds[i + 1]) attending over everything written so far.
    Returns (outputs of the computed rows, the cache). A `prefix_cache` holds the
    rows before bounds[0], written by an earlier request."""
    q, k, v = prompt
    cache = prefix_cache or PagedKVCache(1, 4, KV_HEADS, BLOCK, HEAD_DIM, dtype, DEVICE)
    scales = cache.layer_scales(0)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        slots = torch.arange(start, end, device=DEVICE)
        ops.write_kv(k[start:end], v[start:end], cache.k[0], cache.v[0], slots, scales=scales)
        cu = torch.tensor([0, end - start], dtype=torch.int32, device=DEVICE)
        lens = torch.tensor([end], dtype=torch.int32, device=DEVICE)
        out = ops.paged_prefill_attention(
            q[start:end], cache.k[0], cache.v[0], table, cu, lens, HEAD_DIM**-0.5, window, scales=scales
        )
        outs.append(out)
    return torch.cat(outs), cache


@pytest.mark.parametrize("dtype", [quant.FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("window", [0, 20])
def test_chunking_and_prefix_hits_give_identical_outputs(backend, dtype, window):
    ops = {"torch": reference, "triton": triton_ops}[backend]
    prompt = _prompt(0)
    whole, _ = _attend_in_chunks(ops, dtype, prompt, [0, LENGTH], window=window)
    chunked, _ = _attend_in_chunks(ops, dtype, prompt, [0, 7, 16, 33, LENGTH], window=window)
    # A first request computes the two full blocks; a second one finds them cached
    # and computes only the tail.
    _, cached = _attend_in_chunks(ops, dtype, prompt, [0, 2 * BLOCK], window=window)
    tail, _ = _attend_in_chunks(ops, dtype, prompt, [2 * BLOCK, LENGTH], prefix_cache=cached, window=window)
    assert torch.equal(chunked, whole)
    assert torch.equal(tail, whole[2 * BLOCK :])


@pytest.mark.parametrize("dtype", [quant.FP8_DTYPE, torch.int8], ids=["fp8", "int8"])
def test_chunk_reads_its_own_tokens_quantized(dtype):
    """The chunk's own K/V are read back dequantized, never in full precision: the
    output equals attention over the quantize-then-dequantize round trip."""
    q, k, v = _prompt(1)
    out, _ = _attend_in_chunks(reference, dtype, (q, k, v), [0, LENGTH])
    k_rt, v_rt = (quant.dequantize(*quant.quantize(x, dtype)) for x in (k, v))
    cu = torch.tensor([0, LENGTH], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([LENGTH], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    plain = PagedKVCache(1, 4, KV_HEADS, BLOCK, HEAD_DIM, torch.float32, DEVICE)
    slots = torch.arange(LENGTH, device=DEVICE)
    reference.write_kv(k_rt, v_rt, plain.k[0], plain.v[0], slots)
    want = reference.paged_prefill_attention(q, plain.k[0], plain.v[0], table, cu, lens, HEAD_DIM**-0.5)
    assert torch.equal(out, want)
