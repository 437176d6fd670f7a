"""Sampling in a tensor-parallel worker: rank 0 samples from the logits it
gathered (layers.VocabParallelHead) and broadcasts the sampled ids, so every
rank keeps the same ids for the next step's `token_from_previous_step` decodes
(runner.last_samples.LastSamples) and builds the same input. One [N] broadcast per
step, on the device. Logprobs, alternatives and prompt logprobs stay on rank 0,
the only rank whose results are returned."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker_svc.sampling.packed import Packed, PackedLayout, TokenSampler
from worker_svc.sampling.params import SamplingParams

if TYPE_CHECKING:
    from worker_svc.parallel.group import TensorParallelGroup


class SamplingRank:
    """A TokenSampler. Rank 0: sample (the wrapped sampler), then broadcast the ids.
    Other ranks: receive them."""

    def __init__(self, sampler: TokenSampler, group: TensorParallelGroup):
        self.sampler = sampler
        self.group = group

    def sample_packed(self, logits: torch.Tensor, params: SamplingParams) -> Packed:
        if self.group.rank == 0:
            packed = self.sampler.sample_packed(logits, params)
            self.group.broadcast_from_first(packed.token_ids.contiguous())
            return packed
        ids = self.group.broadcast_from_first(torch.empty(len(params), dtype=torch.long, device=logits.device))
        # Only the ids: this rank's results are never returned.
        pairs = torch.stack([ids.double(), torch.zeros_like(ids, dtype=torch.float64)], dim=1)
        return Packed(pairs, PackedLayout(len(params), np.zeros(0, dtype=np.int64), 0))
