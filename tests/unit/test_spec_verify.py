"""Greedy verification (worker_svc/sampling/verify.py) against the rule written
as a loop: walk the drafts, keep each one the model would have picked, stop at
the first it would not and take the model's token there."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker_svc.sampling.verify import accept_greedy, verify_drafts


def reference(logits_rows: list[torch.Tensor], drafts: list[int]) -> tuple[int, int, float, list[float]]:
    """(accepted, bonus token, its logprob, the accepted drafts' logprobs) of one row:
    logits_rows[i] follows chunk position i."""
    kept: list[float] = []
    for i, draft in enumerate(drafts):
        logprobs = torch.log_softmax(logits_rows[i].double(), -1)
        choice = int(logits_rows[i].argmax())
        if choice != draft:
            return i, choice, float(logprobs[choice]), kept
        kept.append(float(logprobs[draft]))
    last = logits_rows[len(drafts)]
    choice = int(last.argmax())
    return len(drafts), choice, float(torch.log_softmax(last.double(), -1)[choice]), kept


def test_accept_greedy_examples():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 9, 9]])
    targets = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [4, 6, 7, 8], [1, 9, 9, 9]])
    num = torch.tensor([3, 3, 3, 1])  # the last row carries one draft: its padding never counts
    assert accept_greedy(drafts, num, targets).tolist() == [3, 1, 0, 1]


@pytest.mark.parametrize("seed", range(5))
def test_verify_drafts_agrees_with_the_loop(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    vocab = 7  # small: drafts often match, runs of every length occur
    counts = rng.integers(1, 6, size=12)
    rows = [torch.randn(int(k) + 1, vocab, generator=gen) for k in counts]
    drafts: list[list[int]] = []
    for row, k in zip(rows, counts):
        # Mostly the model's own choices (long accepted runs), sometimes anything.
        picks = row.argmax(dim=-1)[: int(k)].tolist()
        drafts.append([p if rng.random() < 0.8 else int(rng.integers(vocab)) for p in picks])
    inner = torch.cat([row[:-1] for row in rows])
    last_ids = torch.stack([row[-1].argmax() for row in rows])
    last_lp = torch.stack([torch.log_softmax(row[-1], -1)[i] for row, i in zip(rows, last_ids)])
    last = torch.stack([last_ids.double(), last_lp.double()], dim=1)
    flat = torch.tensor([d for ds in drafts for d in ds])
    accepted, bonus, inner_logprobs = verify_drafts(inner, last, flat, counts.astype(np.int64))
    expected = [reference(list(row), ds) for row, ds in zip(rows, drafts)]
    assert accepted.tolist() == [e[0] for e in expected]
    assert bonus[:, 0].long().tolist() == [e[1] for e in expected]
    assert bonus[:, 1].tolist() == pytest.approx([e[2] for e in expected], abs=1e-5)
    starts = np.cumsum(counts) - counts
    kept = [inner_logprobs[s : s + e[0]].tolist() for s, e in zip(starts, expected)]
    assert kept == [pytest.approx(e[3], abs=1e-5) for e in expected]
    assert 0 < accepted.sum() < counts.sum()  # both outcomes were exercised
