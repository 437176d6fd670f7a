"""The fused element-wise ops of a decoder layer (issue 27, fault 9) against their
torch references (kernels/reference.py, the oracle): add_rms_norm and rope_write_kv,
as the Triton kernels (kernels/triton/, under TRITON_INTERPRET=1 on CPU) and
the C++ ones (kernels/cpu_ops.py) compute them; and the C++ linear layers the CPU
decoder streams its weights through (kernels/csrc/linear_cpu.cpp) against F.linear.
With CUDA (make gpu-check) the Triton ones run compiled, on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch.nn.functional as F

from kernels import cpu_ops, quant, reference
from kernels import triton as triton_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")


TRITON_DEVICE = torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")


def backends() -> list:
    """(ops module, the device its tensors live on): the Triton ones (compiled on the
    GPU, or interpreted on CPU tensors), the C++ ones where they build."""
    mods = [pytest.param((triton_ops, TRITON_DEVICE), id="triton")]
    mods.append(pytest.param((cpu_ops, torch.device("cpu")), id="cpu", marks=needs_kernels))
    return mods


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = ATOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("ops", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_add_rms_norm_matches_the_reference(ops, dtype, with_residual):
    ops, device = ops
    g = torch.Generator().manual_seed(0)
    rows, hidden = 7, 96
    # x is a strided view (rows of a wider projection output), as the decoder hands it.
    x = (torch.randn(rows, hidden + 32, generator=g) * 3)[:, :hidden].to(dtype)
    residual = (torch.randn(rows, hidden, generator=g) * 5).to(dtype) if with_residual else None
    weight = torch.rand(hidden, generator=g) + 0.5
    x, weight = x.to(device), weight.to(device)
    residual = residual.to(device) if residual is not None else None
    normed, summed = ops.add_rms_norm(x, residual, weight, 1e-6)
    want_normed, want_summed = reference.add_rms_norm(x, residual, weight, 1e-6)
    close(summed, want_summed)
    close(normed, want_normed)
    if dtype == torch.float32 or not with_residual:  # the sum is one rounding either way
        torch.testing.assert_close(summed, want_summed, atol=0, rtol=0)


def make_qkv(tokens, q_heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as the strided slices of one fused QKV output, and cos/sin as the decoder
    computes them (positions 0..tokens-1 at base 10000)."""
    g = torch.Generator().manual_seed(seed)
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g).to(dtype)
    q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(tokens).float()[:, None] * inv_freq[None, :] + 3.0
    emb = torch.cat((freqs, freqs), dim=-1)
    return q, k, v, emb.cos().to(dtype), emb.sin().to(dtype)


CACHE_DTYPES = [None, torch.bfloat16, quant.FP8_DTYPE, torch.int8]  # None: the query's dtype


@pytest.mark.parametrize("ops", backends())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=["same", "bf16", "fp8", "int8"])
def test_rope_write_kv_matches_the_reference(ops, dtype, cache_dtype):
    ops, device = ops
    tokens, q_heads, kv_heads, head_dim, block = 9, 6, 2, 32, 8
    cache_dtype = cache_dtype or dtype
    q, k, v, cos, sin = (t.to(device) for t in make_qkv(tokens, q_heads, kv_heads, head_dim, dtype))
    slots = torch.tensor([17, 3, -1, 40, 41, 0, -1, 9, 63], device=device)  # scattered, two skipped
    caches = {}
    for name in ("ref", "ops"):
        shape = (8, kv_heads, block, head_dim)
        k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
        scales = quant.KVScales.zeros(shape, cache_dtype, k_cache.device)
        fn = reference.rope_write_kv if name == "ref" else ops.rope_write_kv
        caches[name] = (*fn(q, k, v, cos, sin, k_cache, v_cache, slots, scales=scales), k_cache, v_cache, scales)
    (q_ref, k_ref, kc_ref, vc_ref, _), (q_out, k_out, kc, vc, sc) = caches["ref"], caches["ops"]
    close(q_out, q_ref)
    close(k_out, k_ref)
    live = slots >= 0
    blocks, offsets = slots[live] // block, slots[live] % block
    for side, (cache, ref_cache, exact) in enumerate(((kc, kc_ref, k_ref), (vc, vc_ref, v))):
        got = cache[blocks, :, offsets].float()
        if sc is None:
            tol = max(ATOL[dtype], ATOL.get(cache_dtype, 0.0))
            torch.testing.assert_close(got, ref_cache[blocks, :, offsets].float(), atol=tol, rtol=tol)
            continue
        # Quantized: what the cache holds dequantizes to the rotated value within
        # half a quantization step (FP8 e4m3: 1/16 of the value, or the subnormal
        # step; INT8: half the scale), as the reference's does.
        scale, zero = sc.sides[side]
        got = quant.dequantize(cache, scale, zero)[blocks, :, offsets]
        want = exact[live].float()
        step = scale[blocks, :, offsets][..., None]
        bound = (want.abs() / 16 + step / 512 if cache_dtype == quant.FP8_DTYPE else step / 2) * 1.05
        assert bool(((got - want).abs() <= bound + ATOL[dtype] * (want.abs() + 1)).all())
    # Slots < 0 write nothing: every block row not named by a slot stays zero.
    written = torch.zeros(8 * block, dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    untouched = (~written).view(8, block)
    assert not kc.float().permute(0, 2, 1, 3)[untouched].any()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 6, 7, 8, 10, 13, 17, 300])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (100, 37), (960, 576)])
def test_linear_matches_f_linear(dtype, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, in_features + 5, generator=g).to(dtype)[:, :in_features]  # strided rows
    packed = cpu_ops.pack_linear(weight)
    out = cpu_ops.linear(x, packed, out_features, in_features)
    expected = F.linear(x.float(), weight.float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter", [32, 50, 1536])
@pytest.mark.parametrize("rows", [6, 13])
def test_gated_linear_matches_the_mlp(dtype, activation, inter, rows):
    g = torch.Generator().manual_seed(inter)
    hidden = 64
    weight = (torch.randn(2 * inter, hidden, generator=g) * 0.2).to(dtype)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    out = cpu_ops.linear(x, cpu_ops.pack_linear(weight, gated=True), inter, hidden, activation)
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    act = reference.activate(gate, activation)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), (act * up).to(dtype).float(), atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("inter", [32, 50, 1536])
@pytest.mark.parametrize("rows", [1, 13])
def test_gated_act_matches_the_reference(dtype, activation, inter, rows):
    """act(gate) * up over a projection's [gate, up] rows (a strided view, as a wider
    output's columns), the tail past a whole vector included (inter 50), and the same
    values the fused gated linear computes from the same products."""
    g = torch.Generator().manual_seed(inter + rows)
    y = (torch.randn(rows, 2 * inter + 8, generator=g) * 4)[:, : 2 * inter].to(dtype)
    out = cpu_ops.gated_act(y, activation)
    assert out.shape == (rows, inter) and out.dtype == dtype
    close(out, reference.gated_act(y, activation))
    # Wide swings of the gate: exp(-|g|) must neither overflow nor lose the sign.
    extreme = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 1.0, 1.0, 1.0, 1.0, 1.0]]).to(dtype)
    close(cpu_ops.gated_act(extreme, activation), reference.gated_act(extreme, activation))
    # One formula with the fused gated linear: an identity weight hands it y's values.
    hidden = 2 * inter
    fused = cpu_ops.linear(
        y.contiguous(), cpu_ops.pack_linear(torch.eye(hidden, dtype=dtype), gated=True), inter, hidden, activation
    )
    assert torch.equal(out, fused)


@needs_kernels
def test_gated_act_refuses_what_it_does_not_take():
    with pytest.raises(RuntimeError, match="silu or gelu_tanh"):
        torch.ops.pagedserve_cpu.gated_act(torch.randn(2, 8), "relu")
    with pytest.raises(RuntimeError, match="2 x intermediate"):
        torch.ops.pagedserve_cpu.gated_act(torch.randn(2, 7), "silu")
    # fp16 is the reference's (the op takes fp32 and bf16).
    y = torch.randn(3, 8).half()
    assert torch.equal(cpu_ops.gated_act(y, "silu"), reference.gated_act(y, "silu"))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_rows_do_not_depend_on_the_batch(dtype):
    """Each output is summed in k order whatever the batch and the thread count: a row
    computed alone, inside a batch of 5 (one group of rows), of 10 (two groups sharing
    each k-chunk) or of 300, and with 1 or 2 threads is the same bits (a sequence's
    logits do not depend on who shares its step)."""
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(300, 576, generator=g) * 0.05).to(dtype)
    packed = cpu_ops.pack_linear(weight)
    batch = torch.randn(300, 576, generator=g).to(dtype)
    threads = torch.get_num_threads()
    rows = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            rows[n, "alone"] = cpu_ops.linear(batch[7:8], packed, 300, 576)[0]
            rows[n, "of 5"] = cpu_ops.linear(batch[5:10], packed, 300, 576)[2]
            rows[n, "of 10"] = cpu_ops.linear(batch[1:11], packed, 300, 576)[6]
            rows[n, "of 300"] = cpu_ops.linear(batch, packed, 300, 576)[7]
    finally:
        torch.set_num_threads(threads)
    first = rows[1, "alone"]
    for key, row in rows.items():
        assert torch.equal(row, first), key


@needs_kernels
def test_linear_refuses_a_mismatched_weight():
    weight = torch.randn(64, 32)
    packed = cpu_ops.pack_linear(weight)
    with pytest.raises(RuntimeError, match="features"):
        cpu_ops.linear(torch.randn(2, 31), packed, 64, 32)
    with pytest.raises(RuntimeError, match="packed weight does not match"):
        cpu_ops.linear(torch.randn(2, 32), packed, 64, 32, "silu")
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ops.linear(torch.randn(2, 32).bfloat16(), packed, 64, 32)
