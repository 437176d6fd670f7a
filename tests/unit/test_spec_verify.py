"""Verification of drafts (worker_svc/sampling/verify.py) against the rule written
as a loop: walk the drafts, sample each position as one-token decoding would
(the row's options, its penalties counting the drafts before the position, a
seeded row's noise keyed by (seed, position)), keep each draft equal to that
sample, stop at the first that is not and take the sample there. And the
rejection rule's promise for sampled rows: the emitted token has the target
distribution, whatever the draft."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.helpers.worker_steps import Sampling, sampling_params
from worker_svc.sampling.params import SamplingParams
from worker_svc.sampling.sampler import Sampler
from worker_svc.sampling.verify import accepted_prefix, settle, verify_drafts
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import Penalties, SeqColumns

BLOCK = 16


def drafting_step(rows: list[tuple[Sampling, list[int], int, list[int]]]) -> SeqColumns:
    """Sampling rows of (options, chunk prefix before the input, input token, drafts),
    each at start position 0 with one big block table."""
    builder = StepBuilder(BLOCK)
    for i, (s, before, token, drafts) in enumerate(rows):
        chunk = [*before, token, *drafts]
        table = list(range(i * 8, i * 8 + 8))
        builder.add(i, chunk, 0, table, sample=True, **s.step_row(), extras=s.extras())
    seqs = builder.build(1).seqs
    return dataclasses.replace(seqs, num_drafts=np.array([len(d) for *_, d in rows], dtype=np.int64))


def verify(
    sampler: Sampler, seqs: SeqColumns, logits_rows: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the model runner does: the last positions through the sampler, then the
    positions before them through verify_drafts. logits_rows[r]: [K + 1, V]."""
    rows = np.arange(len(seqs))
    counts = seqs.drafts
    last = sampler.sample_packed(torch.stack([r[-1] for r in logits_rows]), SamplingParams.of_rows(seqs, rows))
    inner = torch.cat([r[:-1] for r in logits_rows])
    ends = seqs.token_starts + seqs.num_tokens
    drafts = torch.from_numpy(np.concatenate([seqs.token_ids[e - k : e] for e, k in zip(ends, counts)]))
    params = SamplingParams.of_drafted_positions(seqs, rows)
    return verify_drafts(sampler, inner, params, last.tensor, drafts, counts)


def one_token_at_a_time(
    sampler: Sampler, logits: torch.Tensor, s: Sampling, first_position: int, drafts: list[int]
) -> tuple[int, int, float, list[float]]:
    """(accepted, bonus token, its logprob, the accepted drafts' logprobs) of one row,
    sampling its positions one by one: logits[i] follows chunk position i, whose
    token is at first_position + i, and the penalties count the drafts before it."""
    kept: list[float] = []
    for i in range(len(drafts) + 1):
        at_i = s
        if s.penalties is not None:
            counted = (*s.penalties.output_token_ids, *drafts[:i])
            at_i = dataclasses.replace(s, penalties=dataclasses.replace(s.penalties, output_token_ids=counted))
        pair = sampler.sample_packed(logits[i : i + 1], sampling_params([at_i], [first_position + i])).tensor[0]
        token, logprob = int(pair[0]), float(pair[1])
        if i == len(drafts) or token != drafts[i]:
            return i, token, logprob, kept
        kept.append(logprob)
    raise AssertionError("unreachable")


def test_accepted_prefix_examples():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [1, 9, 9]])
    targets = torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8], [4, 6, 7, 8], [1, 9, 9, 9]])
    num = torch.tensor([3, 3, 3, 1])  # the last row carries one draft: its padding never counts
    assert accepted_prefix(drafts, num, targets).tolist() == [3, 1, 0, 1]


def test_settle_takes_the_target_after_the_accepted_drafts():
    # Two rows: 2 drafts (the first right, the second wrong), 1 draft (right).
    inner = torch.tensor([[4.0, -0.1], [9.0, -0.2], [7.0, -0.3]], dtype=torch.float64)
    last = torch.tensor([[1.0, -1.0], [2.0, -2.0]], dtype=torch.float64)
    accepted, bonus, logprobs = settle(inner, last, torch.tensor([4, 8, 7]), np.array([2, 1]))
    assert accepted.tolist() == [1, 1]
    assert bonus.tolist() == [[9.0, -0.2], [2.0, -2.0]]  # row 0: the target where draft 2 failed
    assert logprobs.tolist() == [-0.1, -0.2, -0.3]


VOCAB = 9  # small: drafts often match, runs of every length occur
OPTIONS = [
    Sampling(),
    Sampling(temperature=0.9, seed=3),
    Sampling(temperature=1.3, top_k=4, top_p=0.9, min_p=0.05, seed=8),
    Sampling(
        temperature=0.0,
        penalties=Penalties(
            presence=0.7, frequency=0.4, repetition=1.4, output_token_ids=(2, 2, 5), prompt_token_ids=(1, 6)
        ),
    ),
    Sampling(
        temperature=0.7, seed=1, blocked_token_ids=(0, 3), logit_bias_token_ids=(4, 7), logit_bias_values=(1.5, -2.0)
    ),
    Sampling(
        temperature=1.1,
        seed=12,
        top_k=5,
        blocked_token_ids=(8,),
        logit_bias_token_ids=(1,),
        logit_bias_values=(0.8,),
        penalties=Penalties(presence=0.3, frequency=0.9, output_token_ids=(1, 4)),
    ),
]


@pytest.mark.parametrize("seed", range(4))
def test_verification_samples_each_position_as_one_token_decoding_would(seed: int):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    sampler = Sampler(seed=0)
    rows, logits_rows, expected = [], [], []
    for _ in range(3):
        for s in OPTIONS:
            k = int(rng.integers(1, 6))
            before = rng.integers(VOCAB, size=int(rng.integers(0, 4))).tolist()
            token = int(rng.integers(VOCAB))
            logits = torch.randn(k + 1, VOCAB, generator=gen) * 2
            first = len(before) + 1  # the position of the token chunk position 0 samples
            # Mostly what one-token decoding picks given the drafts before (long runs), sometimes anything.
            drafts: list[int] = []
            for i in range(k):
                choice = one_token_at_a_time(sampler, logits[: i + 1], s, first, drafts)[1]
                drafts.append(choice if rng.random() < 0.8 else int(rng.integers(VOCAB)))
            rows.append((s, before, token, drafts))
            logits_rows.append(logits)
            expected.append(one_token_at_a_time(sampler, logits, s, first, drafts))
    accepted, bonus, inner_logprobs = verify(sampler, drafting_step(rows), logits_rows)
    assert accepted.tolist() == [e[0] for e in expected]
    assert bonus[:, 0].long().tolist() == [e[1] for e in expected]
    assert bonus[:, 1].tolist() == pytest.approx([e[2] for e in expected], abs=1e-5)
    counts = np.array([len(d) for *_, d in rows])
    starts = np.cumsum(counts) - counts
    kept = [inner_logprobs[s : s + e[0]].tolist() for s, e in zip(starts, expected)]
    assert kept == [pytest.approx(e[3], abs=1e-5) for e in expected]
    assert 0 < accepted.sum() < counts.sum()  # both outcomes were exercised
    sampled = [i for i, (s, *_) in enumerate(rows) if s.temperature > 0]
    assert 0 < accepted[sampled].sum() < counts[sampled].sum()


def test_penalties_at_a_verified_position_count_the_drafts_before_it():
    """A greedy row whose model would repeat the drafted token: with a presence
    penalty that outweighs the margin, the position after the draft must not pick
    it again, exactly as one-token decoding (which generated the draft) would not."""
    logits = torch.full((2, VOCAB), -5.0)
    logits[:, 3], logits[:, 4] = 2.0, 1.5  # 3 leads by 0.5 at both positions
    s = Sampling(penalties=Penalties(presence=1.0))
    accepted, bonus, _ = verify(Sampler(), drafting_step([(s, [], 1, [3])]), [logits])
    assert (accepted.item(), int(bonus[0, 0])) == (1, 4)  # the draft 3 kept; then 3 is penalized: 4


def target_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """p of one row as the sampler's filters define it (docs/design.md section 9), written
    plainly: min-p on the probabilities after temperature, then top-k and top-p over
    what is left (a token stays while the mass before it is < top_p), renormalized."""
    probs = torch.softmax(logits.double() / temperature, -1).numpy()
    keep = probs >= min_p * probs.max()
    order = sorted(np.flatnonzero(keep), key=lambda t: -probs[t])
    left = probs * keep / (probs * keep).sum()
    kept, mass = [], 0.0
    for rank, t in enumerate(order):
        if rank >= top_k or mass >= top_p:
            break
        kept.append(t)
        mass += left[t]
    p = np.zeros_like(probs)
    p[kept] = probs[kept]
    return p / p.sum()


def test_the_emitted_token_has_the_target_distribution():
    """Many seeds, one position, a draft that the target picks about a third of the
    time: the first token emitted (the draft when accepted, else the rejection's
    sample) follows p; the draft is accepted with probability p(draft); a rejected
    position's token follows p without the draft, renormalized. Fixed seeds: the
    outcome is deterministic, and the bounds are the chi-square's 99.9% quantiles."""
    n = 8000
    logits = torch.tensor([2.0, 1.6, 0.9, 0.7, 0.2, -0.5, -1.0, -3.0, -4.0])
    temperature, top_k, top_p, min_p = 0.9, 7, 0.97, 0.01
    p = target_distribution(logits, temperature, top_k, top_p, min_p)
    draft = 1
    assert 0.2 < p[draft] < 0.45 and (p > 0).sum() >= 5
    s = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows = [(dataclasses.replace(s, seed=1000 + i), [], 0, [draft]) for i in range(n)]
    bonus_logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    accepted, bonus, _ = verify(Sampler(), drafting_step(rows), [torch.stack([logits, bonus_logits])] * n)
    first = torch.where(accepted == 1, draft, bonus[:, 0].long()).numpy()
    counts = np.bincount(first, minlength=VOCAB)
    support = p > 0
    assert counts[~support].sum() == 0  # nothing the filters cut is ever emitted
    chi2 = ((counts[support] - n * p[support]) ** 2 / (n * p[support])).sum()
    assert chi2 < CHI2_999[int(support.sum()) - 1], (counts, n * p)
    rate = float(accepted.double().mean())
    assert abs(rate - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    rejected = counts.copy()
    rejected[draft] = 0
    residual = p.copy()
    residual[draft] = 0
    residual /= residual.sum()
    m, live = rejected.sum(), residual > 0
    chi2 = ((rejected[live] - m * residual[live]) ** 2 / (m * residual[live])).sum()
    assert chi2 < CHI2_999[int(live.sum()) - 1]


# The chi-square distribution's 99.9% quantile by degrees of freedom.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
