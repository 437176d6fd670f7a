"""FP8 / INT8 KV caches: quantize math (kernels/quant.py), the quantizing write and
dequantizing attention of both op sets (kernels/reference.py, kernels/triton/),
block copies with their scales, memory accounting and the FP8 -> INT8 fallback.

Without a GPU the Triton kernels run under the interpreter (tests/conftest.py);
shapes are small. Attention tolerances follow vLLM's FP8 KV-cache kernel tests
(tests/kernels/attention/test_attention.py): values drawn uniform in
(-head_dim^-0.5, head_dim^-0.5), softmax scale head_dim^-0.5, and
``atol=1e-2, rtol=1e-5`` once the cache is FP8. vLLM compares against a
reference that reads the same dequantized cache; here the reference is the fp32
cache itself, so the tolerance covers the quantization error too.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kernels import (
    quant,
    reference,
)
from kernels import triton as triton_ops
from kernels.quant import KVScales
from tests.helpers.sweeps import sweep
from worker_svc.attention.kv_cache import PagedKVCache

DEVICE = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")
QDTYPES = [quant.FP8_DTYPE, torch.int8]
QIDS = ["fp8", "int8"]
OPS = {"torch": reference, "triton": triton_ops}
VLLM_FP8_ATOL, VLLM_FP8_RTOL = 1e-2, 1e-5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cache(num_blocks, num_kv_heads, head_dim, dtype, block_size=16) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """One layer's k_cache, v_cache and (for a quantized dtype) its scales."""
    layer = PagedKVCache(1, num_blocks, num_kv_heads, block_size, head_dim, dtype, DEVICE)
    return layer.k[0], layer.v[0], layer.layer_scales(0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t


def _assert_same_cache(a, b):
    """(k, v, scales) of two caches hold the same bits."""
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(_bits(a[1]), _bits(b[1]))
    assert len(a[2].tensors) == len(b[2].tensors)
    for x, y in zip(a[2].tensors, b[2].tensors):
        assert torch.equal(x, y)


def _dequantized(k_cache, v_cache, scales) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        quant.dequantize(k_cache, scales.k_scale, scales.k_zero),
        quant.dequantize(v_cache, scales.v_scale, scales.v_zero),
    )


def _slots(table: list[int], start: int, count: int, block_size=16) -> torch.Tensor:
    return torch.tensor(
        [table[p // block_size] * block_size + p % block_size for p in range(start, start + count)], device=DEVICE
    )


# --------------------------------------------------------------------------- quantize / dequantize


def _rows() -> torch.Tensor:
    """Token-head rows that stress a per-row scale: magnitudes from 1e-6 to 1e3, an
    outlier channel, one-signed rows, an all-zero row, fp8-subnormal-sized values."""
    g = _gen(0)
    rows = [torch.randn(64, 64, generator=g) * 10.0 ** torch.randint(-6, 4, (64, 1), generator=g)]
    outlier = torch.randn(8, 64, generator=g)
    outlier[:, 3] = 1000.0
    rows += [
        outlier,
        torch.rand(4, 64, generator=g) + 0.5,
        -torch.rand(4, 64, generator=g),
        torch.zeros(2, 64),
        torch.randn(4, 64, generator=g) * 1e-3 + 1.0,
        torch.linspace(-1, 1, 64)[None],
    ]
    return torch.cat(rows).to(DEVICE)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_round_trip_within_documented_bounds(dtype):
    x = _rows()
    q, scale, zero = quant.quantize(x, dtype)
    assert q.dtype == dtype and scale.dtype == quant.SCALE_DTYPE and scale.shape == x.shape[:-1]
    assert (zero is not None) == quant.has_zero_point(dtype)
    back = quant.dequantize(q, scale, zero)
    amax = x.abs().amax(-1, keepdim=True)
    bound = quant.ROUND_TRIP_BOUNDS[dtype]
    allowed = bound["rel"] * x.abs() + bound["amax_frac"] * amax + 1e-6 * amax  # + fp32 arithmetic
    assert (back - x).abs().le(allowed).all(), float(((back - x).abs() - allowed).max())
    # Zeros (and all-zero rows) come back exactly; every nonzero row uses its full range.
    assert torch.equal(back[x == 0], torch.zeros_like(back[x == 0]))
    nonzero = amax[:, 0] > 0
    if dtype == torch.int8:
        assert zero.dtype == torch.int8 and int(zero.min()) >= -128 and int(zero.max()) <= 127
        assert ((q[nonzero] == 127) | (q[nonzero] == -128)).any(-1).all()
    else:
        assert torch.equal(q.float().abs().amax(-1)[nonzero], torch.full_like(scale[nonzero], quant.FP8_MAX))
    # The bound is not vacuous: typical errors are well inside it.
    rel = ((back - x).abs() / amax.clamp(min=1e-30))[nonzero]
    assert float(rel.mean()) < {quant.FP8_DTYPE: 0.02, torch.int8: 0.002}[dtype]


def test_reference_and_triton_signatures_match():
    import inspect

    ops = ["write_kv", "paged_prefill_attention", "paged_decode_attention", "copy_blocks"]
    for name in [*ops, "contiguous_prefill_attention", "contiguous_decode_attention"]:
        ref, tri = inspect.signature(getattr(reference, name)), inspect.signature(getattr(triton_ops, name))
        assert ref == tri, name
        keywords = [p for p in ref.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        want = [("scales", None)] + ([("softcap", 0.0)] if name.endswith("attention") else [])
        assert [(p.name, p.default) for p in keywords] == want, name


def test_scale_bytes_and_codes():
    assert quant.scale_bytes_per_token_head(quant.FP8_DTYPE) == 4  # fp32 scale
    assert quant.scale_bytes_per_token_head(torch.int8) == 5  # fp32 scale + int8 zero point
    assert quant.scale_bytes_per_token_head(torch.bfloat16) == 0
    assert [quant.quant_code(d) for d in (torch.float32, quant.FP8_DTYPE, torch.int8)] == [0, 1, 2]


# --------------------------------------------------------------------------- writes


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("backend", list(OPS))
def test_token_by_token_equals_whole_block(backend, dtype):
    """Filling blocks one decode step at a time, in uneven chunks, or in one write
    gives the same cache: values AND scales (the scale is per token, never revised)."""
    ops = OPS[backend]
    kv_heads, head_dim, n = 2, 32, 37  # two full blocks and a partial one
    g = _gen(1)
    key = (torch.randn(n, kv_heads, head_dim, generator=g) * torch.rand(n, 1, 1, generator=g) * 8).to(DEVICE)
    value = torch.randn(n, kv_heads, head_dim, generator=g).to(DEVICE)
    table = [5, 0, 3]
    whole = _cache(8, kv_heads, head_dim, dtype)
    ops.write_kv(key, value, whole[0], whole[1], _slots(table, 0, n), scales=whole[2])
    for chunks in ([1] * n, [7, 1, 16, 13]):
        parts = _cache(8, kv_heads, head_dim, dtype)
        start = 0
        for size in chunks:
            ops.write_kv(
                key[start : start + size],
                value[start : start + size],
                parts[0],
                parts[1],
                _slots(table, start, size),
                scales=parts[2],
            )
            start += size
        _assert_same_cache(parts, whole)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["f32-in", "bf16-in"])
def test_triton_write_matches_torch(dtype, input_dtype):
    """Same bits in values, scales and zero points; skipped slots untouched; K/V
    as non-contiguous views of one qkv row, as the model hands them over."""
    kv_heads, head_dim, n = 2, 24, 21
    qkv = (torch.randn(n, 3 * kv_heads, head_dim, generator=_gen(2)) * 3).to(DEVICE, input_dtype)
    key, value = qkv[:, :kv_heads], qkv[:, kv_heads : 2 * kv_heads]
    slots = torch.randperm(8 * 16, generator=_gen(3))[:n]
    slots[[0, 7, 20]] = -1
    slots = slots.to(DEVICE)
    caches = {}
    for name, ops in OPS.items():
        caches[name] = _cache(8, kv_heads, head_dim, dtype)
        for t in (caches[name][0], caches[name][1], *caches[name][2].tensors):
            t.view(torch.uint8).fill_(0x11)  # so that a write to a skipped slot shows
        ops.write_kv(key, value, caches[name][0], caches[name][1], slots, scales=caches[name][2])
    _assert_same_cache(caches["triton"], caches["torch"])


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_copy_blocks_copies_scales(dtype):
    cache = PagedKVCache(2, 8, 2, 16, 32, dtype, DEVICE)
    g = _gen(4)
    for layer in range(2):
        k, v = (torch.randn(20, 2, 32, generator=g).to(DEVICE) for _ in range(2))
        reference.write_kv(k, v, *cache.layer(layer), _slots([1, 2], 0, 20), scales=cache.layer_scales(layer))
    cache.copy_blocks([1, 2], [6, 4])
    for t in cache.tensors:
        assert torch.equal(_bits(t[:, 6]), _bits(t[:, 1])) and torch.equal(_bits(t[:, 4]), _bits(t[:, 2]))
    assert len(cache.tensors) == (6 if dtype == torch.int8 else 4)
    # Reading through the copy gives bit-identical attention (same values, same scales).
    query = torch.randn(1, 4, 32, generator=g).to(DEVICE)
    ctx = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    outs = [
        reference.paged_decode_attention(
            query,
            *cache.layer(1),
            torch.tensor([t], dtype=torch.int32, device=DEVICE),
            ctx,
            0.2,
            scales=cache.layer_scales(1),
        )
        for t in ([1, 2], [6, 4])
    ]
    assert torch.equal(outs[0], outs[1])


# --------------------------------------------------------------------------- attention

DECODE_CONTEXTS = [1, 15, 17, 100]
PREFILL = [(16, 48), (5, 18), (33, 70), (1, 1)]  # (new tokens, context)


def _vllm_uniform(shape, head_dim, seed):
    bound = head_dim**-0.5
    return ((torch.rand(shape, generator=_gen(seed)) * 2 - 1) * bound).to(DEVICE)


def _filled(dtype, contexts, kv_heads, head_dim, num_blocks=32):
    """A cache of `dtype` holding every sequence's context K/V (written through
    reference.write_kv), random block tables, and the fp32 K/V that went in."""
    block_size = 16
    per_seq = [-(-c // block_size) for c in contexts]
    perm = torch.randperm(num_blocks, generator=_gen(5))[: sum(per_seq)].tolist()
    tables, slots, start = [], [], 0
    for c, nb in zip(contexts, per_seq):
        table = perm[start : start + nb]
        start += nb
        tables.append(table + [table[0]] * (max(per_seq) - nb))  # padding: any valid id
        slots.append(_slots(table, 0, c))
    slots = torch.cat(slots)
    key = _vllm_uniform((len(slots), kv_heads, head_dim), head_dim, 6)
    value = _vllm_uniform((len(slots), kv_heads, head_dim), head_dim, 7)
    cache = _cache(num_blocks, kv_heads, head_dim, dtype)
    reference.write_kv(key, value, cache[0], cache[1], slots, scales=cache[2])
    return cache, torch.tensor(tables, dtype=torch.int32, device=DEVICE)


def _attend(ops, kind, query, cache, tables, query_lens, contexts, scale, window=0):
    k_cache, v_cache, scales = cache
    ctx = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    if kind == "decode":
        return ops.paged_decode_attention(query, k_cache, v_cache, tables, ctx, scale, window, scales=scales)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return ops.paged_prefill_attention(query, k_cache, v_cache, tables, cu, ctx, scale, window, scales=scales)


def _case(kind):
    if kind == "decode":
        return [1] * len(DECODE_CONTEXTS), DECODE_CONTEXTS
    query_lens, contexts = zip(*PREFILL)
    return list(query_lens), list(contexts)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_attention_vs_fp32_reference(dtype, kind):
    """The torch ops over an FP8/INT8 cache vs the same ops over the fp32 cache of the
    same K/V: within vLLM's FP8 KV tolerance. And dequantize-inside-attention is
    exactly attention over the dequantized cache."""
    q_heads, kv_heads, head_dim = 8, 2, 64
    scale = head_dim**-0.5
    query_lens, contexts = _case(kind)
    query = _vllm_uniform((sum(query_lens), q_heads, head_dim), head_dim, 8)
    quantized, tables = _filled(dtype, contexts, kv_heads, head_dim)
    exact, _ = _filled(torch.float32, contexts, kv_heads, head_dim)
    out = _attend(reference, kind, query, quantized, tables, query_lens, contexts, scale)
    want = _attend(reference, kind, query, exact, tables, query_lens, contexts, scale)
    torch.testing.assert_close(out, want, atol=VLLM_FP8_ATOL, rtol=VLLM_FP8_RTOL)
    err = float((out - want).abs().max())
    # INT8's step is 1/255 of the range, FP8's relative step 1/16: INT8 is far closer.
    assert err < {quant.FP8_DTYPE: VLLM_FP8_ATOL, torch.int8: 1e-3}[dtype], err
    dequantized = (*_dequantized(*quantized), {})
    torch.testing.assert_close(
        out, _attend(reference, kind, query, dequantized, tables, query_lens, contexts, scale), atol=1e-6, rtol=1e-6
    )


ATTENTION_LAYOUTS = [
    ("decode", 0, (8, 2, 64)),
    ("decode", 8, (4, 1, 32)),
    ("prefill", 0, (4, 4, 32)),
    ("prefill", 9, (8, 2, 64)),
]
TRITON_ATTENTION_CASES = [(dtype, *layout) for dtype in QDTYPES for layout in ATTENTION_LAYOUTS]
TRITON_ATTENTION_IDS = [
    f"{q}-{c}" for q in QIDS for c in ["decode-gqa", "decode-mqa-window", "prefill-mha", "prefill-gqa-window"]
]


# make test keeps a diagonal: every layout once (decode and prefill, with and without a
# window, MHA / GQA / MQA) and each quantized dtype on both decode and prefill; the other
# four cases (each an interpreted Triton run) repeat those paths and run in make test-slow.
@pytest.mark.parametrize(
    "dtype,kind,window,heads",
    sweep(
        TRITON_ATTENTION_CASES,
        keep=[TRITON_ATTENTION_CASES[i] for i in (0, 2, 5, 7)],
        ids=TRITON_ATTENTION_IDS,
    ),
)
def test_triton_attention_matches_torch(dtype, kind, window, heads):
    q_heads, kv_heads, head_dim = heads
    query_lens, contexts = _case(kind)
    query = torch.randn(sum(query_lens), q_heads, head_dim, generator=_gen(9)).to(DEVICE)
    cache, tables = _filled(dtype, contexts, kv_heads, head_dim)
    out = _attend(triton_ops, kind, query, cache, tables, query_lens, contexts, 0.3, window)
    want = _attend(reference, kind, query, cache, tables, query_lens, contexts, 0.3, window)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_triton_split_kv_decode_matches_torch(dtype, window):
    """Split-KV decode dequantizes as the single-pass kernel does: the torch op's
    output over the same FP8/INT8 cache, with partitions that cut blocks."""
    contexts = [100, 1, 37, 70]
    query = torch.randn(len(contexts), 8, 32, generator=_gen(12)).to(DEVICE)
    (k_cache, v_cache, scales), tables = _filled(dtype, contexts, 2, 32)
    ctx = torch.tensor(contexts, dtype=torch.int32, device=DEVICE)
    out = triton_ops.split_kv_decode_attention(
        query, k_cache, v_cache, tables, ctx, 0.3, window, num_splits=2, scales=scales
    )
    want = reference.paged_decode_attention(query, k_cache, v_cache, tables, ctx, 0.3, window, scales=scales)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", QDTYPES, ids=QIDS)
def test_triton_attention_bf16_query(dtype):
    """A bf16 model over a quantized cache: dequantized to fp32, then the query dtype."""
    query_lens, contexts = _case("prefill")
    query = torch.randn(sum(query_lens), 8, 64, generator=_gen(10)).to(DEVICE, torch.bfloat16)
    cache, tables = _filled(dtype, contexts, 2, 64)
    out = _attend(triton_ops, "prefill", query, cache, tables, query_lens, contexts, 0.125)
    want = _attend(reference, "prefill", query, cache, tables, query_lens, contexts, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_missing_scales_are_refused():
    k_cache, v_cache, scales = _cache(4, 1, 16, torch.int8)
    key = torch.randn(2, 1, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    for ops in OPS.values():
        with pytest.raises(AssertionError, match="needs its scales"):
            ops.write_kv(key, key, k_cache, v_cache, slots)
        with pytest.raises(AssertionError, match="needs zero points"):
            ops.write_kv(key, key, k_cache, v_cache, slots, scales=KVScales(scales.k_scale, scales.v_scale))


# --------------------------------------------------------------------------- memory, fallback, worker


def test_pool_is_about_half_of_fp16_plus_scales():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 16-token blocks.
    dims = (30, 3, 16, 64)
    fp16 = PagedKVCache.bytes_per_block(*dims, torch.float16)
    assert fp16 == 2 * 30 * 3 * 16 * 64 * 2
    for dtype, per_token_head in ((quant.FP8_DTYPE, 64 + 4), (torch.int8, 64 + 5)):
        per_block = PagedKVCache.bytes_per_block(*dims, dtype)
        assert per_block == 2 * 30 * 3 * 16 * per_token_head
        assert PagedKVCache.scale_bytes_per_block(30, 3, 16, dtype) == per_block - fp16 // 2
        assert 0.5 < per_block / fp16 < 0.55, per_block / fp16
    cache = PagedKVCache(2, 5, 3, 16, 64, torch.int8, DEVICE)
    assert cache.total_bytes == 5 * cache.block_bytes


@pytest.mark.parametrize("kv_dtype,expected", [("fp8", "float8_e4m3fn"), ("int8", "int8")])
def test_worker_sizes_pool_with_scales_and_reports_them(kv_dtype, expected):
    import dataclasses

    from proto import worker_pb2
    from tools.tiny_checkpoints import ensure_checkpoint
    from worker_svc.config import WorkerConfig
    from worker_svc.worker import Worker

    worker = Worker(
        WorkerConfig(model=str(ensure_checkpoint("llama")), dtype="float32", kv_dtype=kv_dtype, kv_cache_memory_mb=1)
    )
    info = worker.info
    assert (info.kv_dtype, info.kv_dtype_requested) == (expected, kv_dtype)
    assert info.num_blocks == 2**20 // info.kv_bytes_per_block
    assert worker.cache.total_bytes == info.num_blocks * info.kv_bytes_per_block <= 2**20
    assert info.kv_bytes_per_token * info.block_size == info.kv_bytes_per_block
    values = 2 * info.num_layers * info.num_kv_heads * info.block_size * info.head_dim  # one byte each
    assert info.kv_scale_bytes_per_block == info.kv_bytes_per_block - values > 0
    reply = worker_pb2.InfoResponse(**dataclasses.asdict(info))  # what the Info RPC sends
    assert (reply.kv_bytes_per_token, reply.kv_scale_bytes_per_block) == (
        info.kv_bytes_per_token,
        info.kv_scale_bytes_per_block,
    )


def test_fp8_falls_back_to_int8_below_sm89(monkeypatch):
    from structlog.testing import capture_logs

    from worker_svc import worker as worker_mod

    capability = {"value": (8, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake A100")
    cuda = torch.device("cuda:0")
    with capture_logs() as logs:
        assert worker_mod.resolve_kv_dtype("fp8", torch.bfloat16, cuda) == torch.int8
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["kv_dtype"] == "int8" and warnings[0]["compute_capability"] == "8.0"
    with capture_logs() as logs:
        capability["value"] = (8, 9)
        assert worker_mod.resolve_kv_dtype("fp8", torch.bfloat16, cuda) == quant.FP8_DTYPE
        capability["value"] = (9, 0)
        assert worker_mod.resolve_kv_dtype("fp8", torch.bfloat16, cuda) == quant.FP8_DTYPE
        assert worker_mod.resolve_kv_dtype("int8", torch.bfloat16, cuda) == torch.int8
        # CPU: FP8 is emulated (torch float8_e4m3fn storage and conversions), not replaced.
        assert worker_mod.resolve_kv_dtype("fp8", torch.float32, torch.device("cpu")) == quant.FP8_DTYPE
        assert worker_mod.resolve_kv_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert not logs


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_worker_triton_backend_matches_torch_quantized(kv_dtype):
    """The whole model (Gemma3: GQA, sliding-window layers) over a quantized cache:
    the Triton backend gives the torch backend's logits over a prefill, a chunk +
    decode step and a decode from copied blocks. Both run the per-op forward
    (--enforce-eager), so only the attention ops differ: the fused norm and RoPE
    kernels round differently in the last fp32 bit (tests/unit/test_fused_ops.py),
    which would change layer 0's inputs and so its quantized bits."""
    from tests.helpers.worker_steps import Seq, sampled, step_input
    from tools.tiny_checkpoints import ensure_checkpoint
    from worker_svc.config import WorkerConfig
    from worker_svc.worker import Worker

    model = str(ensure_checkpoint("gemma3"))
    workers = {
        b: Worker(
            WorkerConfig(
                model=model,
                dtype="float32",
                kv_dtype=kv_dtype,
                num_blocks=16,
                attention_backend=b,
                device=str(DEVICE),
                enforce_eager=True,
            )
        )
        for b in ("torch", "triton")
    }
    prompt = torch.randint(3, workers["torch"].info.vocab_size, (20,), generator=_gen(11)).tolist()

    def seq(seq_id, tokens, start, table):
        slots = [table[p // 16] * 16 + p % 16 for p in range(start, start + len(tokens))]
        return Seq(seq_id, tokens, start, table, slots, sample=True, return_logits=True)

    def run(step):
        outs = {name: w.step(step) for name, w in workers.items()}
        for want, got in zip(sampled(outs["torch"]), sampled(outs["triton"]), strict=True):
            assert want.token_id == got.token_id
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
        return sampled(outs["torch"])[0].token_id

    token = run(step_input(1, [], [seq(1, prompt[:13], 0, [9, 2])]))
    token = run(step_input(2, [], [seq(1, prompt[13:] + [token], 13, [9, 2])]))
    run(step_input(3, [(9, 4), (2, 7)], [seq(2, [token], 21, [4, 7])]))  # decode from the copy
    caches = [w.cache for w in workers.values()]
    if DEVICE.type == "cpu":
        # Layer 0's K/V come straight from the embeddings, and the interpreted norm and
        # RoPE compute torch's bits, so both backends quantize the same inputs: same bits.
        for a, b in zip(caches[0].tensors, caches[1].tensors):
            assert torch.equal(_bits(a[0]), _bits(b[0]))
        return
    # Compiled, the Triton norm and RoPE differ from torch's in the last fp32 bit (its
    # sqrt and divisions, fused multiply-adds: seen on an H200), so a layer-0 value can
    # round to the next quantization level: each is within one level (INT8: the zero
    # point may move one level too) of the torch backend's.
    for side in (0, 1):
        (want_scale, want_zero), (got_scale, got_zero) = (c.layer_scales(0).sides[side] for c in caches)
        want = quant.dequantize(caches[0].layer(0)[side], want_scale, want_zero)
        got = quant.dequantize(caches[1].layer(0)[side], got_scale, got_zero)
        step = torch.maximum(want_scale, got_scale)[..., None]
        if kv_dtype == "fp8":
            bound = torch.maximum(want.abs(), got.abs()) / 8 + step / 256
        else:
            bound = 2 * step
        assert bool(((got - want).abs() <= bound * 1.01 + 1e-6).all()), side


# --------------------------------------------------------------------------- compiled for CUDA

# As tests/unit/test_triton_kernels.py does for the unquantized kernels: compile the
# quantized ones through ptxas without a GPU (FP8 needs sm_89+, INT8 also on sm_80).
_COMPILE_SCRIPT = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import quant
from kernels import triton as T
assert not T.interpreter_enabled()
NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", quant.FP8_DTYPE: "fp8e4nv", torch.int8: "i8"}

def compile(fn, pointers, constexprs, arch, options=None):
    sig = {n: "constexpr" if n in constexprs else pointers.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", arch, 32), options=options)

# (arch, cache, query dtype, decode): FP8 on Hopper, INT8 on Ampere (where FP8 falls back to it).
# The split-KV decode variant too (SPLIT: fp32 partials).
for arch, cache, q, decode, split in (
    (90, quant.FP8_DTYPE, torch.bfloat16, True, False), (80, torch.int8, torch.float32, False, False),
    (90, quant.FP8_DTYPE, torch.bfloat16, True, True), (80, torch.int8, torch.float32, True, True),
):
    c = "*" + NAME[cache]
    zero = "*i8" if cache == torch.int8 else "*fp32"
    scales = dict(k_scale_ptr="*fp32", v_scale_ptr="*fp32", k_zero_ptr=zero, v_zero_ptr=zero)
    capability = (arch // 10, arch % 10)
    meta, options = T.attention_launch(8, 2, 128, 16, q, cache, decode, not decode, capability, False, split)
    io = "*" + NAME[q]
    part = "*fp32" if split else io
    compile(T.attention_kernel.paged_attention_kernel, dict(out_ptr=io, q_ptr=io, k_cache_ptr=c, v_cache_ptr=c,
            block_tables_ptr="*i32", context_lens_ptr="*i32", cu_query_lens_ptr="*i32", part_out_ptr=part,
            part_max_ptr=part, part_sum_ptr=part, **scales), meta, arch, options)
    compile(T.kv_write._write_kv_quant_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", k_cache_ptr=c, v_cache_ptr=c,
            slot_ptr="*i64", **scales), dict(HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_T=16, BLOCK_D=128,
            QUANT=quant.quant_code(cache)), arch)
print("compiled")
"""


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the other tests already run the compiled kernels")
def test_quantized_kernels_compile_for_cuda():
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
