"""The collectives inside a sharded model, as wrappers of its projections
(models/linear.py), so the decoder's code is the same at any tensor-parallel size.

* `RowParallel`: the o and down projections take the rank's slice of their
  input and produce a partial sum: one all-reduce makes it the full output,
  the same on every rank (Megatron's row-parallel linear).
* `VocabParallelHead`: the output projection computes the rank's slice of the
  vocabulary; rank 0 gathers the slices into the whole logits row it samples
  from. The other ranks get their own slice back, which they do not use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker_svc.models.linear import Projection

if TYPE_CHECKING:
    from worker_svc.parallel.group import TensorParallelGroup


class RowParallel:
    def __init__(self, linear: Projection, group: TensorParallelGroup):
        self.linear = linear
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.linear(x))


class VocabParallelHead:
    def __init__(self, linear: Projection, group: TensorParallelGroup, vocab_size: int):
        self.linear = linear
        self.group = group
        self.vocab_size = vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.linear(hidden)
        slices = self.group.gather_to_first(part)
        if slices is None:  # not rank 0
            return part
        return torch.cat(slices, dim=-1)[:, : self.vocab_size]
