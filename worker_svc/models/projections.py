"""The decoder's projections, built in one place (`projection`, `gated_projection`)
so a weight format's own Linear (models/linear.py's factory) hooks in once, and
the biases some families carry (Qwen2's q/k/v, a Llama's attention_bias and
mlp_bias) are added after the multiply, as transformers' nn.Linear does."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence

import torch

from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.linear import Gated, Projection, Weight, dense, gated_linear, make_linear


class Biased:
    """x @ W.T + bias."""

    def __init__(self, linear: Projection, bias: torch.Tensor):
        self.linear = linear
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias


def projection(
    parts: Sequence[Weight],
    bias: torch.Tensor | None,
    cpu_kernel: bool,
    quant_activations: str = "none",
    shared: bool = False,
) -> Projection:
    """The parts' rows stacked (q, k, v: one multiply; models/linear.py's factory).
    shared: the weight is read elsewhere too (a tied head), so kept in the file's layout."""
    linear = make_linear(parts, cpu_kernel=cpu_kernel, quant_activations=quant_activations, shared=shared)
    return linear if bias is None else Biased(linear, bias)


def gated_projection(
    gate: Weight,
    up: Weight,
    bias: torch.Tensor | None,
    activation: str,
    cpu_kernel: bool,
    quant_activations: str = "none",
) -> Projection:
    """act(x @ gate.T + b_gate) * (x @ up.T + b_up), bias = [b_gate; b_up]: the bias
    comes before the activation, so the fused gated kernel cannot take it."""
    if bias is None:
        return gated_linear(gate, up, activation, cpu_kernel=cpu_kernel, quant_activations=quant_activations)
    return Gated(projection([gate, up], bias, cpu_kernel, quant_activations), activation, cpu_kernel)


def tied_head(embed: Weight, tensors: MutableMapping[str, Weight], take: Callable[[str], Weight]) -> Weight:
    """The output projection of a model with tie_word_embeddings: the embeddings. A
    checkpoint that also stores lm_head.weight must store the same matrix."""
    if "lm_head.weight" in tensors and not torch.equal(
        dense(take("lm_head.weight"), torch.float32), dense(embed, torch.float32)
    ):
        raise UnsupportedModel("tie_word_embeddings is true but lm_head.weight differs from the embeddings")
    return embed
