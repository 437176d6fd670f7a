"""The int8-activation kernel over GGUF blocks (kernels/csrc/quant_int8_cpu.cpp) against
its torch reference (kernels/gguf_quant.py's quant_linear_int8): x quantized to the same
quants and scales bit for bit (a Q8_0 identity returns them), and the products within
the fp32 rounding of the per-block scale sums, for every format, odd shapes, a decode's
one row to a batch's 40, fp32 and bf16 activations."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, quant_cpu_ops
from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight, k_scale_min, quant_linear_int8, quantize_activations
from tests.helpers.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")

UNIT = 2.0**-24  # fp32's unit roundoff


def q8_0_identity(k: int) -> QuantizedWeight:
    """Q8_0 blocks of the identity [k, k]: every scale 1.0, quant 1 on the diagonal."""
    quants = torch.eye(k, dtype=torch.int8).reshape(k, k // 32, 32).view(torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).expand(k, k // 32, 2)
    return QuantizedWeight("Q8_0", k, k, torch.cat([one, quants], dim=-1).reshape(k, -1).contiguous())


def test_the_kernel_quantizes_x_as_the_reference():
    k = 128
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    x[0, 32:64] = 0.0  # a zero block: scale 0, quants 0
    x[1, 64:96] = torch.arange(32) - 15.5  # ... and ties: amax 15.5 puts x * 127 / amax on halves
    x[1, 64] = 127.0
    x[1, 65:96] = torch.arange(31) - 14.5  # amax 127: x * 1.0, every value a tie, to even
    q, d = quantize_activations(x)
    assert q[1, 65:96].tolist() == [round(v) for v in (torch.arange(31) - 14.5).tolist()]  # Python rounds to even
    x_hat = (q.float().reshape(3, -1, 32) * d.unsqueeze(-1)).reshape(3, k)  # each product rounded once, as the kernel
    assert torch.equal(quant_cpu_ops.quant_linear_int8(x, q8_0_identity(k)), x_hat)


def offsets(weight: QuantizedWeight) -> torch.Tensor:
    """|the offset| the kernel adds per weight [out, in] where it multiplies unsigned
    quants (w = d * q + offset): Q4_0's 8 * d, Q4_1 / Q5_1's m, Q4_K / Q5_K's dmin * min."""
    elems, size = BLOCK_FORMATS[weight.qtype]
    b = weight.data.reshape(-1, size)

    def f16(at: int) -> torch.Tensor:
        return b[:, at : at + 2].contiguous().view(torch.float16).float().abs()

    if weight.qtype == "Q4_0":
        per = 8 * f16(0).expand(-1, 32)
    elif weight.qtype in ("Q4_1", "Q5_1"):
        per = f16(2).expand(-1, 32)
    elif weight.qtype in ("Q4_K", "Q5_K"):
        per = (f16(2) * k_scale_min(b[:, 4:16])[1].float()).repeat_interleave(32, dim=1)
    else:
        per = torch.zeros(len(b), elems)
    return per.reshape(weight.out_features, weight.in_features)


def assert_within_fp32_scale_sums(got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, rel: float = 0.0):
    """got is quant_linear_int8 (summed in float64) up to the kernel's fp32 rounding: every
    block contributes d_w * d_x * (integer dot) (+ offset * d_x * sum(q_x)), each product
    rounded a few times, and the terms of an output are summed in fp32, one after another
    in a lane (at most K / 16 of them): |error| <= (K / 16 + 8) * u * the sum of the
    terms' magnitudes, which |x_hat| @ (|W| + 2 |offset|) bounds (|d_w q| <= |w| + |offset|)."""
    exact = quant_linear_int8(x.double(), weight)
    q, d = quantize_activations(x)
    x_hat = (q.double().reshape(len(x), -1, 32) * d.double().unsqueeze(-1)).reshape(x.shape)
    magnitude = x_hat.abs() @ (weight.dequantize().double().abs() + 2 * offsets(weight).double()).T
    bound = (x.shape[1] / 16 + 8) * UNIT * magnitude + rel * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item()} beyond the bound"


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 17, 40])  # tiles, panels, x scaled back
def test_the_kernel_multiplies_as_the_reference(qtype: str, rows: int):
    elems = BLOCK_FORMATS[qtype][0]
    k = 3 * 32 if elems == 32 else 2 * elems  # an odd number of 32-blocks
    weight = random_blocks(qtype, out_features=37, in_features=k, seed=rows)  # 37: partial groups of rows
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = quant_cpu_ops.quant_linear_int8(x, weight)
    assert got.dtype == torch.float32
    assert_within_fp32_scale_sums(got, x, weight)
    xb = x.bfloat16()
    got_bf16 = quant_cpu_ops.quant_linear_int8(xb, weight)
    assert got_bf16.dtype == torch.bfloat16
    # the fp32 sums of bf16 x's quants, rounded once to bf16: within half a bf16 ulp (2^-9) of them
    assert_within_fp32_scale_sums(got_bf16.float(), xb.float(), weight, rel=2.0**-8)


def test_int8_moves_the_product_only_by_x_s_rounding():
    """Beside the fp32 path: |int8 - fp32| is at most |x - x_hat| @ |W| (and fp32 sums):
    the weights enter both exactly, only x's 8-bit rounding differs."""
    weight = random_blocks("Q4_1", out_features=64, in_features=256, seed=5)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    q, d = quantize_activations(x)
    x_hat = (q.float().reshape(8, -1, 32) * d.unsqueeze(-1)).reshape(8, 256)
    w = weight.dequantize()
    moved = (quant_cpu_ops.quant_linear_int8(x, weight) - quant_cpu_ops.quant_linear(x, weight)).abs()
    assert moved.max() > 0  # it is another computation
    assert (moved <= (x - x_hat).abs() @ w.abs().T + 1e-4 * (x.abs() @ w.abs().T)).all()


def test_strided_rows_and_empty_batches():
    weight = random_blocks("Q4_1", out_features=8, in_features=64, seed=1)
    wide = torch.randn(3, 96)
    x = wide[:, 16:80]  # rows 96 apart
    assert torch.equal(quant_cpu_ops.quant_linear_int8(x, weight), quant_cpu_ops.quant_linear_int8(x.clone(), weight))
    assert quant_cpu_ops.quant_linear_int8(torch.empty(0, 64), weight).shape == (0, 8)


def test_wrong_shapes_are_refused():
    weight = random_blocks("Q8_0", out_features=4, in_features=64, seed=2)
    op = torch.ops.pagedserve_cpu.quant_linear_int8
    with pytest.raises(RuntimeError, match="quant_linear_int8: data must be uint8"):
        op(torch.randn(1, 64), weight.data, "Q8_0", 5)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        op(torch.randn(1, 48), weight.data, "Q8_0", 4)
    with pytest.raises(RuntimeError, match="IQ4_NL is not decoded"):
        op(torch.randn(1, 64), weight.data, "IQ4_NL", 4)


# the formats this build packs into panels (none without AVX2)
PANEL_FORMATS = [
    q for q in sorted(BLOCK_FORMATS) if cpu_ops.available() and torch.ops.pagedserve_cpu.int8_pack_lanes(q)
]


def panel_in_features(qtype: str) -> int:
    """Three 32-blocks, or two of the K-quants' 256-blocks."""
    return 96 if BLOCK_FORMATS[qtype][0] == 32 else 512


@pytest.mark.parametrize("qtype", PANEL_FORMATS)
def test_a_packed_weight_holds_the_file_s_bytes(qtype: str):
    """pack_int8 permutes the bytes (Int8Panels.unpacked, written from the layout's
    description, puts them back); the rows past the last full group stay as they are."""
    weight = random_blocks(qtype, out_features=37, in_features=panel_in_features(qtype), seed=7)
    packed = quant_cpu_ops.pack_int8(weight)
    assert isinstance(packed, quant_cpu_ops.Int8Panels) and packed.lanes in (8, 16)
    assert packed.data.shape == weight.data.shape and not torch.equal(packed.data, weight.data)
    assert torch.equal(packed.unpacked().data, weight.data)
    tail = 37 // packed.lanes * packed.lanes
    assert torch.equal(packed.data[tail:], weight.data[tail:])


@pytest.mark.parametrize("qtype", PANEL_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 40])
def test_a_packed_weight_multiplies_as_the_file_s(qtype: str, rows: int):
    """Within the reference's bound at every row count, and the same bits as the file's
    layout where that takes the panels too (from 4 rows: a group repacked per call)."""
    k = panel_in_features(qtype)
    weight = random_blocks(qtype, out_features=37, in_features=k, seed=rows)
    packed = quant_cpu_ops.pack_int8(weight)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    got = quant_cpu_ops.quant_linear_int8(x, packed)
    assert_within_fp32_scale_sums(got, x, weight)
    if rows >= 4:
        assert torch.equal(got, quant_cpu_ops.quant_linear_int8(x, weight))
    got_bf16 = quant_cpu_ops.quant_linear_int8(x.bfloat16(), packed)
    assert_within_fp32_scale_sums(got_bf16.float(), x.bfloat16().float(), weight, rel=2.0**-8)
    assert torch.equal(quant_cpu_ops.quant_linear_int8(x.half(), packed), quant_linear_int8(x.half(), weight))


def test_a_layout_this_build_does_not_pack_is_refused():
    """A packed layout of other lanes than this build's, and a format the kernels do not
    decode, are refused by name; on a build without panels a format is not packed."""
    op = torch.ops.pagedserve_cpu.quant_linear_int8
    with pytest.raises(RuntimeError, match="Q8_0x7 is not decoded"):
        op(torch.randn(1, 64), random_blocks("Q8_0", out_features=4, in_features=64, seed=2).data, "Q8_0x7", 4)
    weight = random_blocks("Q5_K", out_features=16, in_features=256, seed=3)
    with pytest.raises(RuntimeError, match="IQ4_NL is not decoded"):
        torch.ops.pagedserve_cpu.pack_int8(weight.data, "IQ4_NL")
    if not PANEL_FORMATS:
        assert quant_cpu_ops.pack_int8(weight) is weight
        with pytest.raises(RuntimeError, match="pack_int8: Q5_K is not packed here"):
            torch.ops.pagedserve_cpu.pack_int8(weight.data, "Q5_K")
