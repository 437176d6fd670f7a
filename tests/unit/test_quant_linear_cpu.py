"""The C++ kernel over GGUF blocks against the torch reference (kernels/gguf_quant.py):
its decode is the reference's bit for bit (x = the identity returns W.T exactly), and
its products within fp32 rounding, for every format, fp32 and bf16 activations, and
row counts from a decode's one to a prefill's chunks. A bf16 batch, where the build has
AVX512-BF16, multiplies the weights rounded to bf16, as the reference does."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, quant_cpu_ops
from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight, quant_linear
from tests.helpers.gguf_blocks import random_blocks

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_the_kernel_decodes_the_reference_bits(qtype: str):
    k = 2 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=7, in_features=k, seed=11)  # 7: a partial group of rows
    assert quant_cpu_ops.takes(weight)
    y = quant_cpu_ops.quant_linear(torch.eye(k), weight)
    assert torch.equal(y, weight.dequantize().T)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 2, 3])  # a decode's few rows: the tiles that decode in registers
def test_the_decode_path_returns_the_reference_bits(qtype: str, rows: int):
    k = 3 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=9, in_features=k, seed=rows)  # 9: two whole groups of 4 and one row
    picks = torch.randperm(k, generator=torch.Generator().manual_seed(rows))[:rows]
    y = quant_cpu_ops.quant_linear(torch.eye(k)[picks], weight)
    assert torch.equal(y, weight.dequantize().T[picks])


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_every_row_count_from_a_decode_to_a_batch(qtype: str):
    k = 3 * BLOCK_FORMATS[qtype][0]  # an odd number of blocks
    weight = random_blocks(qtype, out_features=13, in_features=k, seed=3)  # 13: partial groups of output rows
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    for rows in range(1, 41):
        assert_within_fp32_sums(quant_cpu_ops.quant_linear(x[:rows], weight), x[:rows], weight)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 5, 70])  # a decode, a verification chunk, a prefill (packed tiles)
def test_the_kernel_multiplies_as_the_reference(qtype: str, rows: int):
    k = 2 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=37, in_features=k, seed=rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    assert_within_fp32_sums(quant_cpu_ops.quant_linear(x, weight), x, weight)
    xb = x.bfloat16()
    got_bf16 = quant_cpu_ops.quant_linear(xb, weight)
    assert got_bf16.dtype == torch.bfloat16
    # fp32 sums of the bf16 inputs, rounded once to bf16: within half a bf16 ulp (2^-9) of them, plus fp32's error
    assert_within_fp32_sums(got_bf16.float(), xb.float(), bf16_batch_weights(weight, rows), rel=2.0**-8)


def bf16_rows() -> int:
    """The rows of bf16 x from which this build multiplies the weights rounded to bf16 (0: never)."""
    return int(torch.ops.pagedserve_cpu.quant_linear_bf16_rows())


def bf16_batch_weights(weight: QuantizedWeight, rows: int) -> torch.Tensor:
    """The weights `rows` rows of bf16 x are multiplied by: rounded to bf16 from
    bf16_rows() rows (the reference's `.to(x.dtype)`), else as decoded."""
    dense = weight.dequantize()
    return dense.bfloat16().float() if bf16_rows() and rows >= bf16_rows() else dense


@pytest.mark.skipif(not bf16_rows(), reason="no AVX512-BF16 in this build: bf16 x multiplies the fp32 decoded weights")
@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_a_bf16_batch_multiplies_the_weights_rounded_to_bf16(qtype: str):
    """From bf16_rows() rows: the weights decoded, rounded to bf16 (the reference's
    F.linear(x, W.to(bf16)), the bf16 checkpoint's values) and summed in fp32, over
    groups of 32 output rows (70: two and a partial one), tiles of 6 rows of x and a
    partial one, x's rows strided. The fp32 decoded weights' product is not within the
    same bound everywhere: the test tells the two apart."""
    k = 4 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=70, in_features=k, seed=9)
    rows = bf16_rows() + 7
    x = torch.randn(rows, k + 48, generator=torch.Generator().manual_seed(9))[:, 16 : 16 + k].bfloat16()
    got = quant_cpu_ops.quant_linear(x, weight).double()
    rounded = weight.dequantize().bfloat16().double()
    exact = x.double() @ rounded.T
    bound = 1e-6 * (x.double().abs() @ rounded.abs().T) + 2.0**-8 * exact.abs()
    assert ((got - exact).abs() <= bound).all()
    from_fp32 = x.double() @ weight.dequantize().double().T
    assert ((got - from_fp32).abs() > bound).any()
    alone = quant_cpu_ops.quant_linear(x[: bf16_rows()], weight.rows(torch.arange(32, 70)))
    assert torch.equal(alone.double(), got[: bf16_rows(), 32:70])


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [8, 60])  # a batch (dot-product tiles), a larger one (packed, broadcast tiles)
def test_a_batch_over_panels_of_output_rows(qtype: str, rows: int):
    """300 output rows: a batch decodes them in panels of several groups (the last panel
    and group partial); each output is still one tile's sum, so its bits do not depend
    on the panel it falls in."""
    k = 2 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=300, in_features=k, seed=5)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(5))
    y = quant_cpu_ops.quant_linear(x, weight)
    assert_within_fp32_sums(y, x, weight)
    for first, last in ((0, 4), (40, 57), (288, 300)):
        alone = quant_cpu_ops.quant_linear(x, weight.rows(torch.arange(first, last)))
        assert torch.equal(alone, y[:, first:last])


def assert_within_fp32_sums(
    got: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight | torch.Tensor, rel: float = 0.0
) -> None:
    """got is x @ W.T up to fp32 summation error: |got - exact| <= 1e-6 * (|x| @ |W|.T) (about
    16 ulps of the sum of the magnitudes) + rel * |exact|. weight: blocks, or their values."""
    dense = (weight.dequantize() if isinstance(weight, QuantizedWeight) else weight).double()
    exact = x.double() @ dense.T
    bound = 1e-6 * (x.double().abs() @ dense.abs().T) + rel * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item()} beyond the bound"


def test_strided_rows_and_empty_batches():
    weight = random_blocks("Q4_1", out_features=8, in_features=64, seed=1)
    wide = torch.randn(3, 96)
    x = wide[:, 16:80]  # rows 96 apart
    torch.testing.assert_close(quant_cpu_ops.quant_linear(x, weight), quant_linear(x, weight), rtol=1e-5, atol=1e-5)
    assert quant_cpu_ops.quant_linear(torch.empty(0, 64), weight).shape == (0, 8)


def test_wrong_shapes_are_refused():
    weight = random_blocks("Q8_0", out_features=4, in_features=64, seed=2)
    with pytest.raises(RuntimeError, match="data must be uint8"):
        torch.ops.pagedserve_cpu.quant_linear(torch.randn(1, 64), weight.data, "Q8_0", 5)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        torch.ops.pagedserve_cpu.quant_linear(torch.randn(1, 48), weight.data, "Q8_0", 4)
    with pytest.raises(RuntimeError, match="IQ4_NL is not decoded"):
        torch.ops.pagedserve_cpu.quant_linear(torch.randn(1, 64), weight.data, "IQ4_NL", 4)


@pytest.mark.parametrize("op", ["quant_linear", "quant_linear_int8"])
def test_both_ops_refuse_the_same_arguments_by_name(op: str):
    weight = random_blocks("Q4_K", out_features=4, in_features=256, seed=5)
    call = getattr(torch.ops.pagedserve_cpu, op)
    with pytest.raises(RuntimeError, match=f"{op}: x must be \\[M, K\\] with contiguous rows"):
        call(torch.randn(1, 2, 256), weight.data, "Q4_K", 4)
    with pytest.raises(RuntimeError, match=f"{op}: fp32 or bf16 x"):
        call(torch.zeros(1, 256, dtype=torch.int32), weight.data, "Q4_K", 4)
    with pytest.raises(RuntimeError, match=f"{op}: K 128 is not a multiple of 256"):
        call(torch.randn(1, 128), weight.data, "Q4_K", 4)
    with pytest.raises(RuntimeError, match=f"{op}: data must be uint8 \\[out_features, K / 256 \\* 144\\]"):
        call(torch.randn(1, 256), weight.data, "Q4_K", 3)
