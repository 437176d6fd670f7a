"""Every result of a step's sampling in one device tensor of (token id, logprob)
pairs, so one copy brings them all to the host; and `TokenSampler`, what the
model runner samples through (a Sampler, or a tensor-parallel rank's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.sampling.params import SamplingParams
from worker_svc.step.input import IntArray

HostPairs = npt.NDArray[np.float64]  # [K, 2] (token id, logprob): the packed tensor on the host


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each result sits in the packed [K, 2] (token id, logprob) tensor: the
    samples, then `top_n` alternatives for each of `top_rows` (sample rows that
    asked, up to the most any asked), then one pair per prompt row (its target),
    then `prompt_top_n` alternatives for each of `prompt_top_rows`."""

    num_samples: int
    top_rows: IntArray
    top_n: int
    num_prompt_rows: int = 0
    prompt_top_rows: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prompt_top_n: int = 0

    def top(self, host: HostPairs) -> dict[int, HostPairs]:
        """Sample row -> its alternatives [top_n, 2], most likely first."""
        block = host[self.num_samples : self.num_samples + self.top_rows.size * self.top_n]
        return dict(zip(self.top_rows.tolist(), block.reshape(self.top_rows.size, self.top_n, 2)))

    def prompt(self, host: HostPairs) -> tuple[HostPairs, IntArray, HostPairs]:
        """([prompt rows, 2] target id and logprob, prompt_top_rows, their alternatives
        [len(prompt_top_rows), prompt_top_n, 2])."""
        start = self.num_samples + self.top_rows.size * self.top_n
        targets = host[start : start + self.num_prompt_rows]
        top = host[start + self.num_prompt_rows :].reshape(self.prompt_top_rows.size, self.prompt_top_n, 2)
        return targets, self.prompt_top_rows, top


@dataclass(frozen=True, slots=True)
class Packed:
    tensor: torch.Tensor  # [K, 2] float64 on the logits' device
    layout: PackedLayout

    @property
    def token_ids(self) -> torch.Tensor:
        """The sampled ids, on the device."""
        return self.tensor[: self.layout.num_samples, 0].long()


class TokenSampler(Protocol):
    def sample_packed(self, logits: torch.Tensor, params: SamplingParams) -> Packed:
        """Samples the first len(params) rows of `logits` and scores the rows after
        them for params.prompt; everything in one device tensor (PackedLayout)."""
        ...
