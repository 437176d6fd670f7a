"""Prompt logprobs: which rows of a step's batch score prompt tokens, and their
results taken back out of the sampler's packed host copy.

A sequence asks with `prompt_logprob_targets`: the token that follows each of
the first len(targets) positions of its chunk. The logits at those positions
are computed with the sampled rows' (one lm_head call) and scored by the
sampler (sampler.PromptScoring).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.sampler import PackedLayout, PromptScoring
from worker_svc.step_input import SeqInput, ranges


@dataclass(frozen=True, slots=True)
class PromptLogprobsOut:
    seq_id: int
    logprobs: np.ndarray  # [targets] float
    top_token_ids: np.ndarray  # [targets * top_n] int, row after row
    top_logprobs: np.ndarray  # [targets * top_n] float


@dataclass(frozen=True, slots=True)
class PromptRows:
    seq_ids: list[int]
    counts: np.ndarray  # targets per sequence
    top_n: np.ndarray  # alternatives per sequence
    rows: np.ndarray  # the batch row of each target's position
    scoring: PromptScoring

    @classmethod
    def of(cls, seqs: Sequence[SeqInput]) -> PromptRows | None:
        """`seqs` in the batch's token order; None when none asks."""
        asking = [k for k, s in enumerate(seqs) if len(s.prompt_logprob_targets)]
        if not asking:
            return None
        lens = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        starts = np.cumsum(lens) - lens
        chosen = [seqs[k] for k in asking]
        counts = np.array([len(s.prompt_logprob_targets) for s in chosen], dtype=np.int64)
        top_n = np.array([s.prompt_top_logprobs for s in chosen], dtype=np.int64)
        targets = np.concatenate([np.asarray(s.prompt_logprob_targets, dtype=np.int64) for s in chosen])
        return cls(
            [s.seq_id for s in chosen],
            counts,
            top_n,
            ranges(starts[asking], counts),
            PromptScoring(targets, np.repeat(top_n, counts)),
        )

    def rows_on(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.rows).to(device)

    def unpack(self, host: np.ndarray, layout: PackedLayout) -> list[PromptLogprobsOut]:
        targets, top_rows, top = layout.prompt(host)
        starts = np.cumsum(self.counts) - self.counts
        out = []
        for seq_id, start, count, n in zip(self.seq_ids, starts, self.counts, self.top_n):
            # A sequence's rows are consecutive, in the alternatives' block too (all or none of them ask).
            first = int(np.searchsorted(top_rows, start))
            mine = top[first : first + count, :n] if n else top[:0, :0]
            out.append(
                PromptLogprobsOut(
                    seq_id,
                    targets[start : start + count, 1].astype(np.float32),
                    mine[..., 0].ravel().astype(np.int64),
                    mine[..., 1].ravel().astype(np.float32),
                )
            )
        return out
