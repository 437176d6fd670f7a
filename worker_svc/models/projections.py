"""The decoder's projections, built in one place (`projection`, `gated_projection`)
so a weight format's own Linear (models/linear.py's factory) hooks in once, and
the biases some families carry (Qwen2's q/k/v, a Llama's attention_bias and
mlp_bias) are added after the multiply, as transformers' nn.Linear does."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

import torch

from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.linear import GatedLinear, Linear, Projection, activate


class Biased:
    """x @ W.T + bias."""

    def __init__(self, linear: Projection, bias: torch.Tensor):
        self.linear = linear
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.bias


class BiasedGated:
    """act(x @ gate.T + b_gate) * (x @ up.T + b_up): the bias comes before the
    activation, so the fused gated kernel cannot take it."""

    def __init__(self, linear: Projection, activation: str):
        self.linear = linear
        self.activation = activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.linear(x).chunk(2, dim=-1)
        return activate(gate, self.activation) * up


def projection(weight: torch.Tensor, bias: torch.Tensor | None, cpu_kernel: bool) -> Projection:
    linear = Linear(weight, cpu_kernel=cpu_kernel)
    return linear if bias is None else Biased(linear, bias)


def gated_projection(weight: torch.Tensor, bias: torch.Tensor | None, activation: str, cpu_kernel: bool) -> Projection:
    """weight = [gate; up] (and bias likewise)."""
    if bias is None:
        return GatedLinear(weight, activation, cpu_kernel=cpu_kernel)
    return BiasedGated(projection(weight, bias, cpu_kernel), activation)


def tied_head(
    embed: torch.Tensor, tensors: MutableMapping[str, torch.Tensor], take: Callable[[str], torch.Tensor]
) -> torch.Tensor:
    """The output projection of a model with tie_word_embeddings: the embeddings. A
    checkpoint that also stores lm_head.weight must store the same matrix."""
    if "lm_head.weight" in tensors and not torch.equal(take("lm_head.weight"), embed):
        raise UnsupportedModel("tie_word_embeddings is true but lm_head.weight differs from the embeddings")
    return embed
