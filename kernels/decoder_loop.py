"""A decoder step's layer loop in one C++ call (kernels/csrc/decoder_loop_cpu.cpp), for
the plain pre-norm layer: add+norm -> qkv (+bias) -> RoPE and the K/V write -> paged
attention -> o (+bias) -> add+norm -> gate-up (+bias, activation) -> down (+bias).

The Python loop (worker_svc/models/decoder.py's `_layer`) and this one call the same
pagedserve_cpu ops in the same order with the same arguments, so their outputs are
bit-identical; what goes is the ~20 Python frames and the wrappers' checks of every
layer (bench/results/hostloop.md). worker_svc/models/layer_loop.py decides at load
which models take it; a step's attention says whether the step does (`LoopStep`).

    PAGEDSERVE_LAYER_LOOP=0   never take it (the Python loop runs every layer)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels import cpu_build

# The projection ops the loop calls, by their pagedserve_cpu names.
PROJECTION_OPS = ("linear", "quant_linear", "quant_linear_int8")


def enabled() -> bool:
    """Whether the loop may run here: not switched off, and the C++ kernels built."""
    return os.environ.get("PAGEDSERVE_LAYER_LOOP", "1") != "0" and cpu_build.load()


@dataclass(frozen=True)
class LoopStep:
    """A step's attention as the loop takes it: one group of rows (every sequence
    decoding, or every one a prefill chunk) over an unquantized cache, read by the
    pagedserve_cpu paged attention. Made by worker_svc/attention/cache_attention.py."""

    k_cache: Tensor  # the whole pool [layers, ids, kv_heads, tokens per id, head_dim]
    v_cache: Tensor
    slot_mapping: Tensor  # int64 [T]
    block_tables: Tensor  # int32 [S, blocks] (a contiguous cache: [S, 1], the slots)
    cu_query_lens: Tensor | None  # int32 [S + 1]; None: one row per sequence (decode)
    context_lens: Tensor  # int32 [S]
    scale: float
    softcap: float


@dataclass(frozen=True)
class LoopPart:
    """One multiply: `op` (PROJECTION_OPS) over `weight`: a packed weight for linear
    (with the activation it fuses over a gated packed weight), GGUF blocks of `qtype`
    for quant_linear[_int8]."""

    op: str
    weight: Tensor
    out_features: int
    in_features: int
    qtype: str = ""
    activation: str = ""


@dataclass(frozen=True)
class LoopProjection:
    """One projection as the loop runs it: its parts' outputs side by side (several:
    blocks of different formats), then the bias, then `gated` (act(gate) * up, "silu" or
    "gelu_tanh") where the op did not fuse it."""

    parts: tuple[LoopPart, ...]
    bias: Tensor | None = None
    gated: str = ""


@dataclass(frozen=True)
class LoopLayer:
    attn_norm: Tensor  # fp32, contiguous
    mlp_norm: Tensor
    window: int  # sliding window (0: none)
    qkv: LoopProjection
    o: LoopProjection
    gate_up: LoopProjection
    down: LoopProjection


class LayerLoop:
    """Every layer of a model in one call: (embeddings, cos, sin, step) -> (the last
    layer's MLP output, the stream before it), as the Python loop returns them."""

    def __init__(self, layers: list[LoopLayer], q_heads: int, kv_heads: int, head_dim: int, eps: float):
        self._loop = torch.classes.pagedserve_cpu.DecoderLoop(q_heads, kv_heads, head_dim, eps)
        for layer in layers:
            for p in (layer.qkv, layer.o, layer.gate_up, layer.down):
                for part in p.parts:
                    assert part.op in PROJECTION_OPS, part.op
                    self._loop.add_part(
                        part.op, part.weight, part.qtype, part.out_features, part.in_features, part.activation
                    )
                self._loop.add_projection(p.bias, p.gated)
            self._loop.add_layer(layer.attn_norm, layer.mlp_norm, layer.window)

    def __call__(self, delta: Tensor, cos: Tensor, sin: Tensor, step: LoopStep) -> tuple[Tensor, Tensor]:
        out: tuple[Tensor, Tensor] = self._loop.forward(
            delta,
            cos if cos.is_contiguous() else cos.contiguous(),
            sin if sin.is_contiguous() else sin.contiguous(),
            step.k_cache,
            step.v_cache,
            step.slot_mapping,
            step.block_tables,
            step.cu_query_lens,
            step.context_lens,
            step.scale,
            step.softcap,
        )
        return out
