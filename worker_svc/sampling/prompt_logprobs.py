"""Prompt logprobs: which rows of a step's batch score prompt tokens, and their
results taken back out of the sampler's packed host copy.

A sequence asks with `prompt_logprob_targets` (one of its RowExtras): the token
that follows each of the first len(targets) positions of its chunk. The logits
at those positions are computed with the sampled rows' (one lm_head call) and
scored by the sampler (params.PromptScoring).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker_svc.sampling.packed import HostPairs, PackedLayout
from worker_svc.sampling.params import PromptScoring
from worker_svc.step.input import IntArray, SeqColumns, ranges
from worker_svc.step.output import PromptLogprobsOut


@dataclass(frozen=True, slots=True)
class PromptRows:
    seq_ids: list[int]
    counts: IntArray  # targets per sequence
    top_n: IntArray  # alternatives per sequence
    rows: IntArray  # the batch row of each target's position
    scoring: PromptScoring

    @classmethod
    def of(cls, seqs: SeqColumns, order: IntArray) -> PromptRows | None:
        """The step's rows laid out in the batch in `order`; None when none asks.
        Only the rows with extras are looked at."""
        asking = [row for row, e in seqs.extras.items() if len(e.prompt_logprob_targets)]
        if not asking:
            return None
        where = np.empty(len(seqs), dtype=np.int64)
        where[order] = np.arange(len(order))
        asking.sort(key=lambda row: where[row])  # batch order
        lens = seqs.num_tokens[order]
        batch_starts = (np.cumsum(lens) - lens)[where[asking]]
        chosen = [seqs.extras[row] for row in asking]
        counts = np.array([len(e.prompt_logprob_targets) for e in chosen], dtype=np.int64)
        top_n = np.array([e.prompt_top_logprobs for e in chosen], dtype=np.int64)
        targets = np.concatenate([np.asarray(e.prompt_logprob_targets, dtype=np.int64) for e in chosen])
        return cls(
            seqs.seq_ids[asking].tolist(),
            counts,
            top_n,
            ranges(batch_starts, counts),
            PromptScoring(targets, np.repeat(top_n, counts)),
        )

    def unpack(self, host: HostPairs, layout: PackedLayout) -> list[PromptLogprobsOut]:
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
