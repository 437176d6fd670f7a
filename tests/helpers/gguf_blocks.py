"""Random GGUF blocks for tests: every byte pattern is a valid block except fp16
scales that decode to inf or nan, so the scale fields get finite values."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kernels.gguf_quant import QuantizedWeight

# Byte offsets of each format's fp16 scale fields (d, and dmin or m) in a block.
SCALE_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q5_0": (0,),
    "Q4_1": (0, 2),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_block_bytes(qtype: str, out_features: int, in_features: int, seed: int, scale: float = 0.02) -> np.ndarray:
    """uint8 [out_features, row bytes]: random quantized values, finite random scales
    (random bytes throughout for a format not served, which only a refusal reads)."""
    elems, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(out_features * in_features // elems, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS.get(qtype, ()):
        values = (rng.standard_normal(len(blocks)) * scale).astype(np.float16)
        blocks[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(out_features, -1)


def random_blocks(qtype: str, out_features: int, in_features: int, seed: int) -> QuantizedWeight:
    data = torch.from_numpy(random_block_bytes(qtype, out_features, in_features, seed))
    return QuantizedWeight(qtype, out_features, in_features, data)
