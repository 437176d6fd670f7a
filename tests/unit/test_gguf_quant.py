"""GGUF block formats: the torch reference decodes random blocks of every served type
bit for bit as the gguf package's numpy dequantizer (the format's own oracle), and
quant_linear is that dequantization multiplied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight, quant_linear, stack
from tests.helpers.gguf_blocks import random_blocks


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_dequantize_matches_gguf(qtype: str):
    weight = random_blocks(qtype, out_features=24, in_features=2 * BLOCK_FORMATS[qtype][0], seed=1)
    expected = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[qtype])
    got = weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == (24, weight.in_features)
    assert np.isfinite(expected).all()
    # bit for bit: the same fp32 operations in the same order
    assert torch.equal(got, torch.from_numpy(expected)), qtype


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_quant_linear_is_the_dequantized_matmul(qtype: str):
    weight = random_blocks(qtype, out_features=8, in_features=BLOCK_FORMATS[qtype][0], seed=2)
    x = torch.randn(3, weight.in_features)
    dense = torch.from_numpy(gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[qtype]))
    assert torch.equal(quant_linear(x, weight), x @ dense.T)


def test_stack_and_rows_keep_the_bytes():
    a, b = (random_blocks("Q8_0", 4, 64, seed=s) for s in (3, 4))
    both = stack([a, b])
    assert both is not None and both.out_features == 8
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert stack([a, random_blocks("Q4_0", 4, 64, seed=5)]) is None  # mixed formats stay apart
    perm = torch.tensor([3, 0, 2, 1])
    assert torch.equal(a.rows(perm).dequantize(), a.dequantize()[perm])


def test_malformed_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="IQ2_XS"):
        QuantizedWeight("IQ2_XS", 1, 256, torch.zeros(1, 66, dtype=torch.uint8))
    with pytest.raises(ValueError, match="Q4_0: in_features 48"):
        QuantizedWeight("Q4_0", 1, 48, torch.zeros(1, 18, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected uint8"):
        QuantizedWeight("Q8_0", 2, 32, torch.zeros(2, 33, dtype=torch.uint8))
