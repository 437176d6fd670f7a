"""The weight-streaming kernels' software prefetch (kernels/csrc/weight_prefetch.h) is a
hint only: with it off every GGUF tile (fp32 and int8 activations, the decode and the
batch tiles) and every quantized safetensors kernel returns the bits it returns with it
on, and the switch says what it was. What it buys is measured, not tested
(bench/cpu/weight_stream.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import pytest
import torch

from kernels import cpu_ops, quant_cpu_ops, wquant_cpu
from kernels.gguf_quant import BLOCK_FORMATS
from tests.helpers.gguf_blocks import random_blocks
from tests.helpers.wquant_weights import WEIGHTS

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernels are not built here")


@pytest.fixture
def prefetch_restored() -> Iterator[None]:
    was = cpu_ops.use_weight_prefetch(True)
    yield
    cpu_ops.use_weight_prefetch(was)


def same_bits_either_way(call: Callable[[], torch.Tensor]) -> None:
    cpu_ops.use_weight_prefetch(True)
    on = call()
    assert cpu_ops.use_weight_prefetch(False) is True
    off = call()
    assert cpu_ops.use_weight_prefetch(True) is False
    assert torch.equal(on, off)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 40])  # the decode tiles, the batch tiles
def test_gguf_kernels_return_the_same_bits_with_the_prefetch_off(prefetch_restored, qtype, rows):
    k = 2 * BLOCK_FORMATS[qtype][0]
    weight = random_blocks(qtype, out_features=203, in_features=k, seed=rows)  # 203: a partial tile at the end
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    same_bits_either_way(lambda: quant_cpu_ops.quant_linear(x, weight))
    same_bits_either_way(lambda: quant_cpu_ops.quant_linear_int8(x, weight))


def test_wquant_kernels_return_the_same_bits_with_the_prefetch_off(prefetch_restored):
    taken = [weight for weight in (make() for make in WEIGHTS.values()) if wquant_cpu.takes(weight)]
    assert taken, "no safetensors weight here that the C++ kernel takes"
    g = torch.Generator().manual_seed(5)
    for weight in taken:
        x = torch.randn(2, weight.in_features, generator=g)
        same_bits_either_way(partial(wquant_cpu.wquant_linear, x, weight))
