"""Greedy verification of draft tokens (speculative decoding, docs/design.md).

A row with K drafts runs its input token and the K drafts as one chunk of K + 1
positions. The logits at chunk position i predict the token after it, so the
model's own greedy choice there is target i = argmax(logits[i]), i in [0, K]:
target 0 follows the input token, target K follows the last draft. The row
keeps the longest prefix of drafts with draft i + 1 == target i (its accepted
count a, 0 <= a <= K) and then the model's token after them, target a (the
bonus): a + 1 tokens for one forward, exactly what a + 1 greedy decode steps
would have produced, since each accepted draft is the token those steps would
have picked.

Greedy only: the scheduler puts drafts only in rows whose temperature is 0 and
which ask for no logit processing or alternatives (step/validation.py refuses
anything else), so the targets here are plain argmaxes, as the sampler's
greedy rows are. The worker decides nothing: the drafts, and how many a row
carries, come in the step.
"""

from __future__ import annotations

import torch

from worker_svc.step.input import IntArray


def accept_greedy(drafts: torch.Tensor, num_drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[R] accepted drafts per row: the length of the longest prefix with
    drafts[r, i] == targets[r, i] among the row's first num_drafts[r] drafts.

    drafts [R, K] (padding beyond num_drafts[r] is ignored), num_drafts [R],
    targets [R, K + 1] (target i follows chunk position i)."""
    width = drafts.shape[1]
    counted = torch.arange(width, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (drafts == targets[:, :width]) & counted
    return match.long().cumprod(dim=1).sum(dim=1)


def verify_drafts(
    inner_logits: torch.Tensor, last: torch.Tensor, drafts: torch.Tensor, counts: IntArray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted [R], (token id, logprob) [R, 2] float64 of each row's bonus token,
    [D] float64 logprob of the argmax at each inner position: an accepted draft's).

    inner_logits [D, V]: the logits at the chunk positions before the last of
    every drafting row, row after row (D = counts.sum()); last [R, 2]: the
    sampler's (token, logprob) at each row's last position (its target K);
    drafts [D]: the draft tokens, row after row; counts [R] (host): drafts per row.
    Logprobs are of the raw distribution, as the sampler's."""
    rows, width = len(counts), int(counts.max()) if len(counts) else 0
    device = inner_logits.device
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), torch.from_numpy(counts).to(device))
    starts = torch.from_numpy(counts.cumsum() - counts).to(device)
    column = torch.arange(len(drafts), device=device) - starts[row_of]
    logits = inner_logits.float()
    inner_ids = logits.argmax(dim=-1)
    inner_logprobs = logits.gather(1, inner_ids[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
    # targets / logprobs [R, width + 1]: the inner positions, then the last one at column counts[r].
    ends = torch.from_numpy(counts).to(device)
    targets = torch.full((rows, width + 1), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, width + 1), dtype=torch.float64, device=device)
    targets[row_of, column] = inner_ids
    logprobs[row_of, column] = inner_logprobs.double()
    every = torch.arange(rows, device=device)
    targets[every, ends] = last[:, 0].long()
    logprobs[every, ends] = last[:, 1].double()
    padded = torch.full((rows, width), -1, dtype=torch.long, device=device)
    padded[row_of, column] = drafts.long()
    accepted = accept_greedy(padded, ends, targets)
    bonus = torch.stack([targets[every, accepted].double(), logprobs[every, accepted]], dim=1)
    return accepted, bonus, inner_logprobs.double()
