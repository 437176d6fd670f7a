"""Verification of draft tokens (speculative decoding, docs/design.md section 13).

A row with K drafts runs its input token and the K drafts as one chunk of K + 1
positions. The logits at chunk position i predict the token after it, so the
token one-token decoding would pick there is target i = the sampler's choice at
position i, i in [0, K]: target 0 follows the input token, target K the last
draft. Each position is sampled exactly as a one-token decode of it would be:
the row's logit processing with its penalties counting the drafts before it
(params.SamplingParams.of_drafted_positions), its temperature and filters, and
a seeded row's noise keyed by (seed, the position of the token it samples). The
row keeps the longest prefix of drafts with draft i + 1 == target i (its
accepted count a, 0 <= a <= K) and then target a (the bonus): a + 1 tokens for
one forward.

Why this is the rejection rule. A greedy row's target is the argmax: a draft is
kept exactly when greedy decoding would have produced it. A sampled row's
target i is a Gumbel race over the filtered distribution p_i, so it equals the
(deterministic, n-gram) draft d with probability p_i(d): that is the acceptance
test "accept d with probability p_i(d) / q(d)", q being the point mass on d.
Given that the race did not pick d, its winner is distributed as p_i without d,
renormalized: the residual max(0, p_i - q) normalized that the rule samples a
rejected position's token from. After K acceptances the bonus is the race at
position K, a sample of p_K. So every emitted token has the target law, and,
since the race's noise is a function of (seed, position) only, a seeded row
emits the same tokens whatever the batch, and the very tokens its one-token
decoding would (equal logits given, up to the float rounding of the chunked
forward). The worker decides nothing: the drafts, and how many a row carries,
come in the step.
"""

from __future__ import annotations

import torch

from worker_svc.sampling.packed import TokenSampler
from worker_svc.sampling.params import SamplingParams
from worker_svc.step.input import IntArray


def accepted_prefix(drafts: torch.Tensor, num_drafts: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[R] accepted drafts per row: the length of the longest prefix with
    drafts[r, i] == targets[r, i] among the row's first num_drafts[r] drafts.

    drafts [R, K] (padding beyond num_drafts[r] is ignored), num_drafts [R],
    targets [R, K + 1] (target i follows chunk position i)."""
    width = drafts.shape[1]
    counted = torch.arange(width, device=drafts.device)[None, :] < num_drafts[:, None]
    match = (drafts == targets[:, :width]) & counted
    return match.long().cumprod(dim=1).sum(dim=1)


def settle(
    inner: torch.Tensor, last: torch.Tensor, drafts: torch.Tensor, counts: IntArray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted [R], (token id, logprob) [R, 2] float64 of each row's bonus token,
    [D] float64 logprob of the target at each inner position: an accepted draft's).

    inner [D, 2]: (target, logprob) at the chunk positions before the last of every
    drafting row, row after row (D = counts.sum()); last [R, 2]: the same at each
    row's last position (its target K); drafts [D]: the draft tokens, row after
    row; counts [R] (host): drafts per row."""
    rows, width = len(counts), int(counts.max()) if len(counts) else 0
    device = inner.device
    row_of = torch.repeat_interleave(torch.arange(rows, device=device), torch.from_numpy(counts).to(device))
    starts = torch.from_numpy(counts.cumsum() - counts).to(device)
    column = torch.arange(len(drafts), device=device) - starts[row_of]
    # targets / logprobs [R, width + 1]: the inner positions, then the last one at column counts[r].
    ends = torch.from_numpy(counts).to(device)
    targets = torch.full((rows, width + 1), -1, dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, width + 1), dtype=torch.float64, device=device)
    targets[row_of, column] = inner[:, 0].long()
    logprobs[row_of, column] = inner[:, 1].double()
    every = torch.arange(rows, device=device)
    targets[every, ends] = last[:, 0].long()
    logprobs[every, ends] = last[:, 1].double()
    padded = torch.full((rows, width), -1, dtype=torch.long, device=device)
    padded[row_of, column] = drafts.long()
    accepted = accepted_prefix(padded, ends, targets)
    bonus = torch.stack([targets[every, accepted].double(), logprobs[every, accepted]], dim=1)
    return accepted, bonus, inner[:, 1].double()


def verify_drafts(
    sampler: TokenSampler,
    inner_logits: torch.Tensor,
    inner_params: SamplingParams,
    last: torch.Tensor,
    drafts: torch.Tensor,
    counts: IntArray,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """settle()'s answer, the inner positions sampled by `sampler` first.

    inner_logits [D, V]: the logits at the chunk positions before the last of
    every drafting row, row after row; inner_params: theirs
    (SamplingParams.of_drafted_positions); last [R, 2]: the sampler's (token,
    logprob) at each row's last position. Logprobs are of the raw distribution,
    as the sampler's."""
    inner = sampler.sample_packed(inner_logits, inner_params).tensor[: len(inner_params)]
    return settle(inner, last, drafts, counts)
