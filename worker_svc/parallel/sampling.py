"""Sampling in a tensor-parallel worker: rank 0 samples from the logits it
gathered (layers.VocabParallelHead) and broadcasts the packed (token id,
logprob) rows, so every rank keeps the same sampled ids for the next step's
`token_from_previous_step` decodes (model_runner.LastSamples) and builds the
same input. One [N, 2] broadcast per step, on the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker_svc.sampler import Sampler
from worker_svc.step_input import Sampling

if TYPE_CHECKING:
    from worker_svc.parallel.group import TensorParallelGroup


class SamplingRank:
    """Rank 0: sample (the wrapped Sampler), then broadcast. Other ranks: receive."""

    def __init__(self, sampler: Sampler, group: TensorParallelGroup):
        self.sampler = sampler
        self.group = group

    def sample_packed(self, logits: torch.Tensor, params: list[Sampling], positions: list[int]) -> torch.Tensor:
        if self.group.rank == 0:
            packed = self.sampler.sample_packed(logits, params, positions)
        else:
            packed = torch.empty(len(params), 2, dtype=torch.float64, device=logits.device)
        return self.group.broadcast_from_first(packed)
