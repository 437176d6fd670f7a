"""The sampler's logit processing (blocked ids, logit_bias, presence / frequency /
repetition penalties) and its logprobs (top-N alternatives, prompt scoring),
checked against plain torch written element by element, plus the promise that
everything still reaches the host in one copy."""

import dataclasses

import numpy as np
import torch

from tests.helpers.host_copies import record_host_copies
from tests.helpers.worker_steps import Sampling, Seq, sampling_params, step_input
from worker_svc.sampling.logits_processing import apply_penalties_
from worker_svc.sampling.params import PromptScoring
from worker_svc.sampling.prompt_logprobs import PromptRows
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.input import Penalties

VOCAB = 48


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def reference_processed(logits: torch.Tensor, s: Sampling, input_token: int | None = None) -> torch.Tensor:
    """One row, the definitions spelt out: -inf, + bias, then vLLM's penalties."""
    row = logits.clone()
    for t in s.blocked_token_ids:
        row[t] = -float("inf")
    for t, b in zip(s.logit_bias_token_ids, s.logit_bias_values):
        row[t] += b
    p = s.penalties
    if p is None:
        return row
    generated = list(p.output_token_ids) + ([input_token] if p.count_input_token else [])
    for t in range(VOCAB):
        count = generated.count(t)
        if count or t in p.prompt_token_ids:
            row[t] = row[t] / p.repetition if row[t] > 0 else row[t] * p.repetition
        row[t] -= p.frequency * count + p.presence * (count > 0)
    return row


def test_penalty_formulas_match_the_definitions():
    logits = _logits(3)
    counts = torch.zeros(3, VOCAB)
    counts[0, 1], counts[0, 2], counts[0, 5], counts[2, 7] = 1, 2, 1, 3
    seen = torch.zeros(3, VOCAB, dtype=torch.bool)
    seen[1, [3, 4]] = True
    presence, frequency = torch.tensor([0.5, 0.0, -1.0]), torch.tensor([0.3, 0.0, 1.5])
    repetition = torch.tensor([1.3, 2.0, 0.5])
    got = apply_penalties_(logits.clone(), counts, seen, presence, frequency, repetition)
    want = logits.clone()
    for r in range(3):
        for t in range(VOCAB):
            c = counts[r, t].item()
            if c or seen[r, t]:
                want[r, t] = want[r, t] / repetition[r] if want[r, t] > 0 else want[r, t] * repetition[r]
            want[r, t] -= frequency[r] * c + presence[r] * (c > 0)
    torch.testing.assert_close(got, want)


PROCESSED = [
    Sampling(blocked_token_ids=(3, 9)),
    Sampling(logit_bias_token_ids=(11, 0, 11), logit_bias_values=(40.0, -5.0, 1.5)),
    Sampling(penalties=Penalties(0.7, 0.4, 1.0, output_token_ids=(1, 1, 2, 30))),
    Sampling(penalties=Penalties(0.0, 0.0, 1.8, output_token_ids=(5,), prompt_token_ids=(6, 7, 8))),
    Sampling(penalties=Penalties(1.5, 2.0, 1.2, output_token_ids=(4,), count_input_token=True)),
    Sampling(
        blocked_token_ids=(0,),
        logit_bias_token_ids=(2,),
        logit_bias_values=(-100.0,),
        penalties=Penalties(-2.0, -2.0, 0.5, output_token_ids=(9, 9, 9), prompt_token_ids=(1,)),
    ),
]


def test_greedy_picks_the_argmax_of_the_processed_logits_and_reports_raw_logprobs():
    plain = [Sampling(), Sampling()]
    params = plain[:1] + PROCESSED + plain[1:]
    logits = _logits(len(params), seed=1)
    inputs = torch.arange(len(params)) + 20  # each sampled position's input token
    # Make each processing decide the winner: the raw argmax is what it blocks or penalises.
    for i, s in enumerate(params):
        p = s.penalties
        penalised = [int(inputs[i])] if p and p.count_input_token else list(p.output_token_ids if p else ())
        target = (list(s.blocked_token_ids) or penalised or [None])[0]
        if target is not None:
            logits[i, target] = logits[i].max() + 0.5
    tokens, logprobs = _sample_host(Sampler(0), logits, params, inputs)
    want = [reference_processed(logits[i], s, int(inputs[i])).argmax().item() for i, s in enumerate(params)]
    assert tokens.tolist() == want
    assert tokens[1] != 3 and tokens[2] == 11  # blocked; biased
    assert (tokens != logits.argmax(dim=-1))[1:-1].all()  # every processing changed the choice
    raw = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, raw)


def _sample_host(sampler, logits, params, inputs=None, positions=None):
    positions = list(range(len(params))) if positions is None else positions
    packed = sampler.sample_packed(logits, sampling_params(params, positions, input_ids=lambda: inputs))
    host = packed.tensor.cpu()
    return host[: len(params), 0].long(), host[: len(params), 1].float()


def test_rows_without_processing_sample_as_if_alone():
    logits = _logits(len(PROCESSED) + 3, seed=2)
    params = [Sampling(0.9, seed=5), *PROCESSED, Sampling(1.3, top_k=5, seed=6), Sampling()]
    inputs = torch.zeros(len(params), dtype=torch.long)
    tokens, _ = _sample_host(Sampler(0), logits, params, inputs)
    alone = [0, len(params) - 2, len(params) - 1]
    want, _ = _sample_host(Sampler(0), logits[alone], [params[i] for i in alone], positions=alone)
    assert tokens[alone].tolist() == want.tolist()


def test_seeded_sampling_never_draws_a_blocked_or_fully_penalised_token():
    logits = torch.zeros(400, VOCAB)
    logits[:, :4] = 5.0  # four likely tokens
    params = [Sampling(1.0, seed=s, blocked_token_ids=(0, 1)) for s in range(200)] + [
        Sampling(1.0, seed=s, logit_bias_token_ids=(2, 3), logit_bias_values=(-100.0, -100.0)) for s in range(200)
    ]
    tokens, _ = _sample_host(Sampler(0), logits, params)
    assert not set(tokens[:200].tolist()) & {0, 1} and set(tokens[:200].tolist()) >= {2, 3}
    assert not set(tokens[200:].tolist()) & {2, 3} and set(tokens[200:].tolist()) >= {0, 1}
    assert params[0].processes_logits and not Sampling(1.0).processes_logits


def test_the_same_seed_draws_from_the_processed_distribution():
    """A penalised row's sample is the Gumbel race over its processed logits: the same
    token as an unprocessed row given those processed logits directly."""
    logits = _logits(6, seed=3)
    params = [dataclass_replace(PROCESSED[k], temperature=0.8, seed=10 + k) for k in (0, 1, 2, 3)]
    tokens, _ = _sample_host(Sampler(0), logits[:4], params)
    processed = torch.stack([reference_processed(logits[i], s) for i, s in enumerate(params)])
    want, _ = _sample_host(Sampler(0), processed, [Sampling(0.8, seed=10 + k) for k in (0, 1, 2, 3)])
    assert tokens.tolist() == want.tolist()


def dataclass_replace(s: Sampling, **changes) -> Sampling:
    return dataclasses.replace(s, **changes)


def test_top_logprobs_are_the_raw_distributions_most_likely_tokens():
    logits = _logits(4, seed=4)
    params = [Sampling(top_logprobs=3), Sampling(), Sampling(0.7, seed=1, top_logprobs=5), PROCESSED[1]]
    params[3] = dataclass_replace(params[3], top_logprobs=2)
    packed = Sampler(0).sample_packed(logits, sampling_params(params, [0, 1, 2, 3]))
    host = packed.tensor.cpu().numpy()
    top = packed.layout.top(host)
    assert sorted(top) == [0, 2, 3] and packed.layout.top_n == 5
    logprobs = torch.log_softmax(logits, dim=-1)
    for row, s in ((0, params[0]), (2, params[2]), (3, params[3])):
        values, ids = logprobs[row].topk(s.top_logprobs)
        got = top[row][: s.top_logprobs]
        assert got[:, 0].astype(int).tolist() == ids.tolist()
        np.testing.assert_allclose(got[:, 1], values.numpy(), atol=1e-5)


def test_prompt_rows_score_their_targets_with_alternatives():
    seqs = [
        Seq(1, [5], 9, [0], [0], sample=True),  # a decode: no prompt logprobs
        Seq(2, [1, 2, 3, 4], 0, [0], [0, 1, 2, 3], prompt_logprob_targets=[2, 3, 4], prompt_top_logprobs=2),
        Seq(3, [7, 8], 16, [0, 1], [16, 17], sample=True),
        Seq(4, [6, 6, 6], 0, [0], [0, 1, 2], prompt_logprob_targets=[6, 6, 9]),
    ]
    rows = PromptRows.of(step_input(1, [], seqs).seqs, np.arange(4))
    assert rows.seq_ids == [2, 4] and rows.rows.tolist() == [1, 2, 3, 7, 8, 9]
    hidden_logits = _logits(10, seed=5)
    samples = [0, 6]  # the last rows of the sampling sequences 1 and 3
    logits = torch.cat([hidden_logits[samples], hidden_logits[rows.rows]])
    packed = Sampler(0).sample_packed(logits, sampling_params([Sampling(), Sampling()], [10, 18], rows.scoring))
    out = rows.unpack(packed.tensor.cpu().numpy(), packed.layout)
    logprobs = torch.log_softmax(hidden_logits, dim=-1)
    first, second = out
    np.testing.assert_allclose(first.logprobs, logprobs[[1, 2, 3], [2, 3, 4]].numpy(), atol=1e-5)
    np.testing.assert_allclose(second.logprobs, logprobs[[7, 8, 9], [6, 6, 9]].numpy(), atol=1e-5)
    values, ids = logprobs[[1, 2, 3]].topk(2)
    assert first.top_token_ids.tolist() == ids.ravel().tolist()
    np.testing.assert_allclose(first.top_logprobs, values.ravel().numpy(), atol=1e-5)
    assert second.top_token_ids.size == 0


def test_prompt_scoring_without_samples():
    logits = _logits(3, seed=6)
    scoring = PromptScoring(np.array([4, 5, 6]), np.array([1, 1, 1]))
    packed = Sampler(0).sample_packed(logits, sampling_params([], [], scoring))
    targets, top_rows, top = packed.layout.prompt(packed.tensor.cpu().numpy())
    logprobs = torch.log_softmax(logits, dim=-1)
    np.testing.assert_allclose(targets[:, 1], logprobs[[0, 1, 2], [4, 5, 6]].numpy(), atol=1e-5)
    assert top_rows.tolist() == [0, 1, 2] and top[:, 0, 0].tolist() == logits.argmax(-1).tolist()


def test_still_one_host_copy_with_processing_and_logprobs(monkeypatch):
    copies = record_host_copies(monkeypatch)
    params = [dataclass_replace(PROCESSED[4], top_logprobs=4), Sampling(1.0, seed=1, top_logprobs=2), PROCESSED[5]]
    logits = _logits(5)
    scoring = PromptScoring(np.array([1, 2]), np.array([3, 0]))
    inputs = torch.tensor([1, 2, 3])
    packed = Sampler(0).sample_packed(logits, sampling_params(params, [0, 1, 2], scoring, lambda: inputs))
    packed.tensor.cpu()
    # 3 samples + 2 rows x 4 alternatives + 2 prompt targets + 1 prompt row x 3 alternatives
    assert copies == [(3 + 8 + 2 + 3, 2)]
