"""The C++ kernel over the quantized safetensors weights (kernels/wquant_cpu.py,
kernels/csrc/wquant_cpu.cpp) against the torch reference (kernels/wquant.py:
dequantize, then multiply): its decode is the reference's bit for bit (x = the
identity, in one batch and a few rows at a time, returns W.T exactly), its products
within fp32 rounding for every layout, fp32 and bf16 activations, 1 to 40 rows, and
shapes whose last group, tile or row block is partial."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, wquant_cpu
from kernels.wquant import Int4Weight, ScaledWeight, WQuantWeight, wquant_linear
from tests.helpers.wquant_weights import WEIGHTS, int4, scaled
from worker_svc.models.linear import WQuantLinear

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels could not be built here")


def assert_within_fp32_sums(got: torch.Tensor, x: torch.Tensor, weight: WQuantWeight, rel: float = 0.0) -> None:
    """|got - exact| <= 1e-6 * (|x| @ |W|.T) (fp32 summation error) + rel * |exact|."""
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T
    bound = 1e-6 * (x.double().abs() @ dense.abs().T) + rel * exact.abs()
    excess = (got.double() - exact).abs() - bound
    assert excess.max() <= 0, f"{excess.max().item()} beyond the bound"


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_the_kernel_decodes_the_reference_bits(name: str):
    weight = WEIGHTS[name]()
    assert wquant_cpu.takes(weight)
    k = weight.in_features
    eye = torch.eye(k)
    expected = weight.dequantize().T
    assert torch.equal(wquant_cpu.wquant_linear(eye, weight), expected)  # the batch path
    for rows in (1, 2, 3):  # the few-rows path: tiles of 2 rows of x, and of 1
        got = torch.cat([wquant_cpu.wquant_linear(eye[i : i + rows], weight) for i in range(0, k, rows)])
        assert torch.equal(got, expected), rows


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_the_kernel_multiplies_as_the_reference(name: str):
    weight = WEIGHTS[name]()
    g = torch.Generator().manual_seed(3)
    for rows in range(1, 41):
        x = torch.randn(rows, weight.in_features, generator=g)
        # bf16: fp32 sums of the bf16 inputs, rounded once to bf16: half a bf16 ulp (2^-9) plus fp32's error
        for dtype, rel in ((torch.float32, 0.0), (torch.bfloat16, 2.0**-8)):
            got = wquant_cpu.wquant_linear(x.to(dtype), weight)
            assert got.dtype == dtype and got.shape == (rows, weight.out_features)
            assert_within_fp32_sums(got.float(), x.to(dtype).float(), weight, rel)


def test_every_fp8_byte_decodes_as_torch_does():
    data = torch.zeros(256, 16, dtype=torch.uint8)
    data[:, 0] = torch.arange(256, dtype=torch.uint8)  # NaN (0x7f, 0xff), subnormals, both zeros, all normals
    weight = ScaledWeight("test", data.view(torch.float8_e4m3fn), torch.ones(1, 1), 256, 16)
    x = torch.zeros(1, 16)
    x[0, 0] = 1.0
    got = wquant_cpu.wquant_linear(x, weight)[0]
    expected = data[:, 0].view(torch.float8_e4m3fn).float()
    assert torch.equal(got.isnan(), expected.isnan()) and int(got.isnan().sum()) == 2
    finite = ~expected.isnan()
    assert torch.equal(got[finite], expected[finite])  # -0.0 as 0.0: a sum of products drops a zero's sign


def act_order(group_of: torch.Tensor, out: int = 8) -> Int4Weight:
    """A GPTQ desc_act weight: input k in group group_of[k] (groups of 32 inputs)."""
    g = torch.Generator().manual_seed(6)
    groups, inputs = int(group_of.max()) + 1, len(group_of)
    scale = (torch.rand(out, groups, generator=g) * 0.1).half()
    zero = torch.randint(0, 16, (out, groups), generator=g, dtype=torch.uint8)
    return Int4Weight("gptq", int4(out, inputs, 32, torch.float16).packed, scale, zero, 32, group_of.to(torch.int32))


def test_an_act_order_weight_is_served_by_the_kernel_in_group_order():
    g = torch.Generator().manual_seed(5)
    weight = act_order(torch.randperm(128, generator=g) // 32)
    assert not wquant_cpu.takes(weight)  # the kernel reads groups as runs only
    served = WQuantLinear(weight, cpu_kernel=True)
    order = served.input_order
    assert order is not None and sorted(order.tolist()) == list(range(128))
    assert served.weight.g_idx is None and served.cpu_op is wquant_cpu.multiply  # type: ignore[union-attr]
    assert torch.equal(served.weight.dequantize(), weight.dequantize()[:, order])  # the same weights, reordered
    for rows in (1, 3, 40):
        x = torch.randn(rows, 128, generator=g)
        assert_within_fp32_sums(served(x), x, weight)
    eager = WQuantLinear(weight, cpu_kernel=False)  # --enforce-eager: the reference, as stored
    assert eager.input_order is None and eager.weight is weight and eager.cpu_op is wquant_linear


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    g = torch.Generator().manual_seed(5)
    uneven_groups = act_order(torch.cat([torch.zeros(40), torch.ones(24)]).long())  # 40 + 24 inputs, not 32s
    narrow_groups = int4(8, 64, 8, torch.float16)  # groups of 8: not whole 16-input decodes
    odd_width = scaled(torch.int8, 8, 40, (1, 10**6))
    for weight in (uneven_groups, narrow_groups, odd_width):
        assert not wquant_cpu.takes(weight)
        x = torch.randn(3, weight.in_features, generator=g)
        assert torch.equal(wquant_cpu.wquant_linear(x, weight), wquant_linear(x, weight))
        served = WQuantLinear(weight, cpu_kernel=True)
        assert served.cpu_op is wquant_linear and served.input_order is None
    taken = int4(8, 64, 32, torch.float16)
    assert WQuantLinear(taken, cpu_kernel=True).cpu_op is wquant_cpu.multiply
    assert WQuantLinear(taken, cpu_kernel=False).cpu_op is wquant_linear  # --enforce-eager: the reference


def test_strided_rows_and_empty_batches():
    weight = int4(8, 64, 32, torch.float16)
    x = torch.randn(3, 96)[:, 16:80]  # rows 96 apart
    assert_within_fp32_sums(wquant_cpu.wquant_linear(x, weight), x, weight)
    assert wquant_cpu.wquant_linear(torch.empty(0, 64), weight).shape == (0, 8)


def test_wrong_shapes_are_refused():
    weight = int4(8, 64, 32, torch.float16)
    op = torch.ops.pagedserve_cpu.wquant_linear
    with pytest.raises(RuntimeError, match="must be multiples of 16"):
        op(torch.randn(1, 40), weight.packed, weight.scale, weight.zero, "int4", 1, 32)
    with pytest.raises(RuntimeError, match=r"data must be one-byte \[N, 32\]"):
        op(torch.randn(1, 64), weight.packed[:, :16].contiguous(), weight.scale, weight.zero, "int4", 1, 32)
    with pytest.raises(RuntimeError, match="int4 takes zero points"):
        op(torch.randn(1, 64), weight.packed, weight.scale, None, "int4", 1, 32)
    with pytest.raises(RuntimeError, match="kind must be int4, int8 or fp8, not nf4"):
        op(torch.randn(1, 64), weight.packed, weight.scale, weight.zero, "nf4", 1, 32)
