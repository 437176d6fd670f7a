"""The token ids the last step sampled: the only state a worker keeps between steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.step.input import IntArray, UIntArray


@dataclass(frozen=True, slots=True)
class LastSamples:
    """The ids the last step sampled, kept where they were sampled (on the device)
    for the decodes of a step planned ahead, which name them instead of carrying
    them. Only the last step's: a worker keeps no other request state."""

    step_id: int
    seq_ids: UIntArray  # [N] the sampled sequences, in the order of token_ids
    token_ids: torch.Tensor  # [N] on the device

    def rows_of(self, seq_ids: UIntArray) -> IntArray:
        """The row of token_ids each of `seq_ids` sampled at; -1 for those that sampled nothing."""
        if not len(self.seq_ids):
            return np.full(len(seq_ids), -1, dtype=np.int64)
        order = np.argsort(self.seq_ids)
        ordered = self.seq_ids[order]
        at = np.minimum(np.searchsorted(ordered, seq_ids), len(ordered) - 1)
        return np.where(ordered[at] == seq_ids, order[at], -1)
