"""The quantized-weight GEMMs (kernels/triton/wquant.py) against their torch
references (kernels/wquant.py: dequantize, then multiply; kernels/wquant_act.py: the
W8A8 products): under TRITON_INTERPRET=1 without a GPU, on the GPU in `make
gpu-check`. Shapes are not multiples of the kernels' tiles; batches of one row
(decode), of many, and of none."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels import wquant_act
from kernels.triton.common import interpreter_enabled
from kernels.wquant import Int4Weight, ScaledWeight, WQuantWeight, wquant_linear
from kernels.wquant_formats import pack_rows

DEVICE = torch.device("cpu" if interpreter_enabled() else "cuda")
OUT, IN = 72, 160  # IN: 5 groups of 32; neither a multiple of the 64-wide tiles
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}


def int4_weight(act_order: bool, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (OUT, IN), generator=g, dtype=torch.uint8)
    groups = IN // 32
    scale = (torch.rand(OUT, groups, generator=g) * 0.02 + 0.005).half()
    zero = torch.randint(0, 16, (OUT, groups), generator=g, dtype=torch.uint8)
    g_idx = torch.argsort(torch.randperm(IN, generator=g)).to(torch.int32) // 32 if act_order else None
    return Int4Weight("test", pack_rows(q), scale, zero, 32, g_idx)


def scaled_weight(dtype: torch.dtype, block: tuple[int, int]) -> ScaledWeight:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.int8:
        data = torch.randint(-128, 128, (OUT, IN), generator=g, dtype=torch.int8)
    else:
        data = (torch.randn(OUT, IN, generator=g) * 100).to(torch.float8_e4m3fn)
    bo, bi = min(block[0], OUT), min(block[1], IN)
    scale = torch.rand(-(-OUT // bo), -(-IN // bi), generator=g) * 0.01 + 0.001
    return ScaledWeight("test", data, scale, bo, bi)


WEIGHTS = {
    "int4": lambda: int4_weight(False),
    "int4-act-order": lambda: int4_weight(True),
    "int8-channel": lambda: scaled_weight(torch.int8, (1, 10**6)),
    "int8-tensor": lambda: scaled_weight(torch.int8, (10**6, 10**6)),
    "fp8-channel": lambda: scaled_weight(torch.float8_e4m3fn, (1, 10**6)),
    "fp8-block": lambda: scaled_weight(torch.float8_e4m3fn, (32, 64)),
}


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def on_device(weight: WQuantWeight) -> WQuantWeight:
    return weight.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("kernel", "tokens"), [("gemm", 1), ("gemm", 37), ("gemm", 0), ("gemv", 1), ("gemv", 3)])
@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_dequantize_in_the_loop_kernels_match_the_reference(kind, kernel, tokens, dtype):
    from kernels.triton import wquant as triton_wquant

    weight = WEIGHTS[kind]()
    x = (torch.randn(tokens, IN, generator=torch.Generator().manual_seed(tokens)) * IN**-0.5).to(dtype)
    expected = wquant_linear(x, weight)
    run = triton_wquant.dequantize_gemv if kernel == "gemv" else triton_wquant.dequantize_in_the_loop
    got = run(x.to(DEVICE), on_device(weight)).cpu()
    assert got.dtype == dtype and got.shape == (tokens, OUT)
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("kind", ["int4-act-order", "fp8-block"])
def test_a_decode_takes_the_gemv_a_batch_the_gemm_and_a_prefill_dequantizes_once(kind, monkeypatch):
    from kernels.triton import wquant as triton_wquant

    weight = on_device(WEIGHTS[kind]())
    ran: list[str] = []
    for name in ("dequantize_gemv", "dequantize_in_the_loop"):
        kernel = getattr(triton_wquant, name)
        monkeypatch.setattr(triton_wquant, name, lambda *a, k=kernel, n=name: ran.append(n) or k(*a))
    gemv, prefill = triton_wquant.GEMV_MAX_TOKENS, triton_wquant.DEQUANTIZE_FROM_TOKENS
    cases = [(gemv, "dequantize_gemv"), (gemv + 1, "dequantize_in_the_loop"), (prefill - 1, "dequantize_in_the_loop"),
             (prefill, None)]  # fmt: skip
    for tokens, kernel in cases:
        ran.clear()
        x = (torch.randn(tokens, IN, generator=torch.Generator().manual_seed(tokens)) * IN**-0.5).to(DEVICE)
        got = triton_wquant.wquant_linear(x, weight)
        assert ran == ([kernel] if kernel else []), tokens
        if kernel is None:  # the reference's own computation on the device: its bits
            assert torch.equal(got, wquant_linear(x, weight))
        torch.testing.assert_close(got.cpu(), wquant_linear(x.cpu(), WEIGHTS[kind]()), **TOL[torch.float32])


@pytest.mark.parametrize(("capability", "fp8"), [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_weights_take_the_reference_on_a_gpu_without_fp8(capability, fp8, monkeypatch):
    from kernels.triton import wquant as triton_wquant

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    gpu = torch.device("cuda", 0)
    assert triton_wquant.triton_decodes(WEIGHTS["fp8-channel"](), gpu) is fp8
    assert triton_wquant.triton_decodes(WEIGHTS["int8-channel"](), gpu)
    assert triton_wquant.triton_decodes(WEIGHTS["int4"](), gpu)
    assert triton_wquant.triton_decodes(WEIGHTS["fp8-channel"](), torch.device("cpu"))  # the interpreter reads it


def test_the_int4_reference_reads_groups_through_g_idx():
    """Act-order: input i's scale and zero are those of group g_idx[i], not i // 32."""
    weight = int4_weight(True)
    assert weight.g_idx is not None
    q = weight.values().float()
    for i in (0, 33, IN - 1):
        g = int(weight.g_idx[i])
        expected = (q[:, i] - weight.zero[:, g].float()) * weight.scale[:, g].float()
        assert torch.equal(weight.dequantize()[:, i], expected)


@pytest.mark.parametrize("tokens", [1, 37, 0])
def test_w8a8_int8_gemm_matches_the_reference(tokens):
    from kernels.triton import wquant as triton_wquant

    weight = scaled_weight(torch.int8, (1, 10**6))
    x = torch.randn(tokens, IN, generator=torch.Generator().manual_seed(5))
    expected = wquant_act.w8a8_linear(x, weight)
    got = triton_wquant.w8a8_linear(x.to(DEVICE), on_device(weight)).cpu()  # type: ignore[arg-type]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # the int32 sums are exact in both


def test_w8a8_reference_sums_the_integer_products_exactly():
    weight = scaled_weight(torch.int8, (1, 10**6))
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(6))
    xq, sx = wquant_act.quantize_rows_int8(x)
    row = [sum(int(a) * int(b) for a, b in zip(xq[1].tolist(), weight.data[4].tolist(), strict=True))]
    expected = torch.tensor(row, dtype=torch.float32) * sx[1] * weight.channel_scales()[4]
    assert torch.equal(wquant_act.w8a8_linear(x, weight)[1, 4:5], expected)
    # and it stays near the W8A16 product (the activations' rounding is the only difference)
    assert relative_error(wquant_act.w8a8_linear(x, weight), wquant_linear(x, weight)) < 0.01


@pytest.mark.parametrize("rows", [OUT, 64], ids=["unaligned", "aligned"])
def test_fp8_linear_matches_the_reference(rows):
    """On a GPU with FP8, 64 x 160 goes through torch._scaled_mm (sides multiples of 16) and
    72 x 160 through the reference; without one, both are the reference."""
    from kernels.triton import wquant as triton_wquant

    full = scaled_weight(torch.float8_e4m3fn, (1, 10**6))
    weight = ScaledWeight("test", full.data[:rows], full.scale[:rows], 1, IN)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(7))
    got = triton_wquant.fp8_linear(x.to(DEVICE), on_device(weight)).cpu()  # type: ignore[arg-type]
    expected = wquant_act.w8a8_linear(x, weight)
    if triton_wquant.has_fp8_mm(DEVICE) and rows % 16 == 0:
        # Hopper's FP8 tensor cores keep about 14 bits of the running sum (DeepSeek-V3's
        # report, 3.3.2), not fp32's 24: a few outputs near zero move by ~1e-3 (seen on an
        # H200: 4 of 320, at most 2.2e-3), the whole product by ~1e-4
        assert relative_error(got, expected) < 1e-3
    else:
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
    assert relative_error(expected, wquant_linear(x, weight)) < 0.05  # fp8 activations: 3 mantissa bits
