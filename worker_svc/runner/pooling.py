"""Pooling rows: a row flagged with a Pooling value (worker.v1 SeqColumns.pooling)
returns its chunk's hidden states (the last layer, after the final norm)
reduced on the device: the last position's, or the sum over the chunk. The
worker keeps no request state, so it never sees a whole prompt that took
several chunks: the scheduler adds up the chunks' sums and divides (mean
pooling) and normalises (scheduler_svc/pooling.py)."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.step.input import IntArray, SeqColumns, ranges
from worker_svc.step.output import PooledRows

POOLING_NONE, POOLING_LAST, POOLING_SUM = 0, 1, 2


def pool_rows(seqs: SeqColumns, order: IntArray, hidden: torch.Tensor) -> PooledRows | None:
    """The pooling rows' vectors, in step order; None when no row pools. `order`
    is the step's rows in batch order (runner/batch.py), `hidden` the forward's [T, hidden]."""
    rows = seqs.pooled_rows
    if not rows.size:
        return None
    where = np.empty(len(seqs), dtype=np.int64)
    where[order] = np.arange(len(order))
    lens = seqs.num_tokens[order]
    starts = (np.cumsum(lens) - lens)[where[rows]]
    ends = starts + seqs.num_tokens[rows]
    last = seqs.pooling[rows] == POOLING_LAST
    # A last-token row reduces one position, a sum row all of its chunk: one index_add for both.
    first = np.where(last, ends - 1, starts)
    counts = ends - first
    positions = ranges(first, counts)
    segments = np.repeat(np.arange(rows.size), counts)
    device = hidden.device
    picked = hidden[torch.from_numpy(positions).to(device)].float()
    out = torch.zeros(rows.size, hidden.shape[1], dtype=torch.float32, device=device)
    out.index_add_(0, torch.from_numpy(segments).to(device), picked)
    return PooledRows(seqs.seq_ids[rows], out.cpu().numpy())
