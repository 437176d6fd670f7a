"""The device sampler: filtering semantics, seeded noise that depends on
(seed, position) alone, the sampled distribution, and one packed host copy."""

import pytest
import torch

from kernels.reference import add_noise, hash32_
from tests.helpers.host_copies import record_host_copies
from tests.helpers.worker_steps import Sampling, sample
from worker_svc.sampling.sampler import Sampler

VOCAB = 64


def _logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax_with_ties_to_lowest_id():
    logits = _logits(5)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1
    tokens, _ = sample(Sampler(0), logits, [Sampling()] * 5, list(range(5)))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[0] == 3


def test_logprobs_are_of_the_chosen_token_under_unscaled_logits():
    logits = _logits(4)
    params = [Sampling(), Sampling(0.5, seed=1), Sampling(2.0, top_k=5, seed=2), Sampling(1.0, top_p=0.3)]
    tokens, logprobs = sample(Sampler(0), logits, params, [0, 1, 2, 3])
    expected = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, expected)


def test_top_k_one_equals_greedy():
    logits = _logits(8)
    params = [Sampling(3.0, top_k=1, seed=s) for s in range(8)]
    tokens, _ = sample(Sampler(0), logits, params, list(range(8)))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_top_k_and_top_p_never_leave_their_set():
    logits = _logits(1).expand(400, VOCAB)
    top5 = set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0] / 1.5, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[(sorted_probs.cumsum(0) - sorted_probs) < 0.6].tolist())
    positions = list(range(400))
    by_k, _ = sample(Sampler(0), logits, [Sampling(1.5, top_k=5, seed=s) for s in range(400)], positions)
    by_p, _ = sample(Sampler(0), logits, [Sampling(1.5, top_p=0.6, seed=s) for s in range(400)], positions)
    assert set(by_k.tolist()) == top5  # every kept token drawn at least once in 400
    assert set(by_p.tolist()) <= nucleus and len(set(by_p.tolist())) > 1


def test_seeded_token_depends_on_seed_and_position_only():
    logits = _logits(6)
    params = [Sampling(1.0, seed=10 + i) for i in range(6)]
    positions = [5, 9, 9, 0, 3, 100]
    alone = [sample(Sampler(i), logits[i : i + 1], params[i : i + 1], positions[i : i + 1])[0].item() for i in range(6)]
    perm = [4, 1, 5, 0, 3, 2]
    extra = _logits(3, seed=9)
    batch = torch.cat([extra, logits[perm]])
    mixed_params = [Sampling(), Sampling(0.8, top_p=0.5), Sampling(1.0, seed=77)] + [params[i] for i in perm]
    tokens, _ = sample(Sampler(123), batch, mixed_params, [1, 2, 3] + [positions[i] for i in perm])
    assert tokens[3:].tolist() == [alone[i] for i in perm]


def test_different_positions_draw_different_tokens():
    logits = torch.zeros(256, VOCAB)  # uniform: the token is the noise's argmax
    tokens, _ = sample(Sampler(0), logits, [Sampling(1.0, seed=42)] * 256, list(range(256)))
    assert len(set(tokens.tolist())) > VOCAB // 2


def test_unseeded_rows_vary_between_steps():
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(0)
    assert len({sample(sampler, logits, [Sampling(1.0)], [0])[0].item() for _ in range(10)}) > 1


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    vocab, draws = 8, 20000
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2]])
    params = [Sampling(temperature, seed=s) for s in range(draws)]
    tokens, _ = sample(Sampler(0), logits.expand(draws, vocab), params, [7] * draws)
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    # Seeds are fixed, so this is deterministic; 0.015 is ~5 sigma at p=0.5.
    assert (freq - expected).abs().max() < 0.015


def test_one_packed_host_copy(monkeypatch):
    copies = record_host_copies(monkeypatch)
    params = [Sampling(), Sampling(1.0, seed=1), Sampling(0.9, top_k=3, top_p=0.8)]
    sample(Sampler(0), _logits(3), params, [0, 1, 2])
    assert copies == [(3, 2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    logits = _logits(64, vocab=4096)
    params = [Sampling(0.5 + (i % 4) * 0.5, top_k=i % 3 * 20, top_p=1.0 - (i % 5) * 0.15, seed=i) for i in range(64)]
    positions = list(range(1000, 1064))
    on_cpu = sample(Sampler(0), logits, params, positions)
    on_cuda = sample(Sampler(0), logits.cuda(), params, positions)
    assert on_cuda[0].tolist() == on_cpu[0].tolist()
    torch.testing.assert_close(on_cuda[1], on_cpu[1])


def test_sparse_noise_picks_what_dense_noise_picks():
    scaled = _logits(256, vocab=2048) * 8  # a spread of ~100, so most tokens are pruned
    keys = torch.arange(256) * 7919
    dense, sparse = add_noise(scaled, keys, prune=False), add_noise(scaled, keys, prune=True)
    kept = sparse > -torch.inf
    assert kept.float().mean() < 0.25
    assert torch.equal(sparse[kept], dense[kept])
    assert torch.equal(sparse.argmax(dim=-1), dense.argmax(dim=-1))


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_tensor_hash_is_exact_32_bit_arithmetic():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    assert hash32_(torch.tensor(values)).tolist() == [_lowbias32(v) for v in values]


# --------------------------------------------------------------------------- the fused race (issue 27, fault 5)


def _race_inputs(rows: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(torch.bfloat16).float()  # bf16 logits: many ties
    temperature = torch.rand(rows, generator=g) * 1.5 + 0.2
    keys = torch.randint(0, 2**32, (rows,), generator=g)
    cut = torch.full((rows,), -torch.inf)
    scaled = logits / temperature[:, None]
    cut[::3] = scaled[::3].topk(7, dim=-1).values[:, -1]  # a top-k cut on every third row
    return logits, temperature, keys, cut


def _triton_device(triton_ops) -> torch.device:
    """Where the Triton kernels' tensors live: the GPU where they run compiled."""
    return torch.device("cpu" if triton_ops.interpreter_enabled() else "cuda")


@pytest.mark.parametrize("vocab", [64, 3001, 5000])  # one tile, several, a last partial one
def test_the_fused_race_is_the_reference(vocab):
    """triton_ops.gumbel_argmax (the one-pass kernel; compiled on CUDA, the
    interpreter here) picks the reference's token on every row: same noise bits,
    same cut, ties to the lowest id, the best token in any tile."""
    from kernels import reference
    from kernels import triton as triton_ops

    device = _triton_device(triton_ops)
    logits, temperature, keys, cut = (t.to(device) for t in _race_inputs(48, vocab))
    logits[1, vocab - 1] = logits[1].max() + 50  # the winner in the last tile
    logits[2, :] = 0.0  # every token ties before the noise
    temperature[2] = 1.0
    expected = reference.gumbel_argmax(logits, temperature, keys, cut)
    got = triton_ops.gumbel_argmax(logits, temperature, keys, cut)
    assert got.tolist() == expected.tolist()
    assert expected[1] == vocab - 1
    kept = logits / temperature[:, None] >= cut[:, None]
    assert kept.gather(1, expected[:, None]).all()


def test_the_sampler_on_the_fused_race_samples_what_the_reference_samples():
    """A batch mixing greedy, temperature, top-k, top-p, min-p and a logit bias,
    through the Sampler with the Triton race and with the torch one: the same
    tokens; and a seeded row alone samples what it samples in the batch."""
    from kernels import triton as triton_ops

    logits = _logits(24, vocab=700).to(_triton_device(triton_ops))
    rows = [
        Sampling(),
        Sampling(0.7, seed=1),
        Sampling(1.3, top_k=9, seed=2),
        Sampling(0.9, top_p=0.6, seed=3),
        Sampling(1.0, min_p=0.2, seed=4),
        Sampling(1.1, top_k=30, top_p=0.8, min_p=0.05, seed=5),
        Sampling(0.8, seed=6, logit_bias_token_ids=[3, 4], logit_bias_values=[5.0, -5.0]),
        Sampling(1.0),
    ] * 3
    positions = list(range(100, 124))
    fused = sample(Sampler(7, gumbel_argmax=triton_ops.gumbel_argmax), logits, rows, positions)[0]
    torch_race = sample(Sampler(7), logits, rows, positions)[0]
    assert fused.tolist() == torch_race.tolist()
    alone = sample(Sampler(0, gumbel_argmax=triton_ops.gumbel_argmax), logits[5:6], rows[5:6], positions[5:6])[0]
    assert alone.item() == fused[5].item()


# --------------------------------------------------------------------------- min-p (issue 28)


def _min_p_set(logits: torch.Tensor, temperature: float, min_p: float) -> set[int]:
    probs = torch.softmax(logits / temperature, dim=-1)
    return set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())


def test_min_p_never_leaves_its_set_and_draws_all_of_it():
    logits = _logits(1)[0]
    kept = _min_p_set(logits, 1.2, 0.1)
    assert 1 < len(kept) < VOCAB // 2
    draws = sample(
        Sampler(0), logits.expand(600, VOCAB), [Sampling(1.2, min_p=0.1, seed=s) for s in range(600)], [3] * 600
    )
    assert set(draws[0].tolist()) == kept


def test_min_p_close_to_one_is_greedy():
    logits = _logits(16)
    tokens, _ = sample(Sampler(0), logits, [Sampling(2.0, min_p=0.999, seed=s) for s in range(16)], list(range(16)))
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_min_p_matches_the_renormalized_softmax():
    """The reference: softmax(logits / T) over the tokens min-p keeps, renormalized."""
    vocab, draws, temperature = 8, 20000, 1.3
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    params = [Sampling(temperature, min_p=0.3, seed=s) for s in range(draws)]
    tokens, _ = sample(Sampler(0), logits.expand(draws, vocab), params, [11] * draws)
    probs = torch.softmax(logits / temperature, dim=-1)
    expected = torch.where(probs >= 0.3 * probs.max(), probs, 0.0)
    expected /= expected.sum()
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (freq[expected == 0] == 0).all()
    assert (freq - expected).abs().max() < 0.015  # ~5 sigma at p=0.5


def test_top_p_is_taken_over_what_min_p_leaves():
    """vLLM's order: min-p first, then top-p over the renormalized survivors. Here
    min-p keeps tokens 0-3 ([4, 3, 3, 2] mass-wise); top-p 0.5 over those keeps the
    first two (mass before the third: 0.56 >= 0.5), where top-p over the whole
    vocabulary (the 60 tail tokens hold most of the mass) would keep more."""
    logits = torch.full((VOCAB,), 0.0)
    logits[:4] = torch.tensor([4.0, 3.8, 3.5, 3.0])
    probs = torch.softmax(logits, dim=-1)
    assert probs[:4].sum() < 0.75  # the tail matters without min-p
    params = [Sampling(1.0, top_p=0.5, min_p=0.2, seed=s) for s in range(400)]
    tokens, _ = sample(Sampler(0), logits.expand(400, VOCAB), params, [0] * 400)
    assert set(tokens.tolist()) == {0, 1}


def test_top_k_keeps_every_token_tied_with_the_last():
    """A cut by value (as vLLM's top-k): tokens tied with the k-th are kept too."""
    logits = torch.zeros(VOCAB)
    logits[:3] = torch.tensor([5.0, 4.0, 4.0])
    params = [Sampling(1.0, top_k=2, seed=s) for s in range(300)]
    tokens, _ = sample(Sampler(0), logits.expand(300, VOCAB), params, [0] * 300)
    assert set(tokens.tolist()) == {0, 1, 2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_seeded_row_samples_the_same_token_on_cuda_and_cpu_whatever_the_batch():
    """The fused race on CUDA (one pass) against the torch reference on CPU: a seeded
    row alone on CPU, and inside a shuffled, mixed batch on CUDA, samples one token."""
    logits = _logits(32, vocab=49152)
    rows = [
        Sampling(0.5 + (i % 3) * 0.4, top_p=1.0 - (i % 4) * 0.1, min_p=(i % 2) * 0.02, seed=100 + i) for i in range(32)
    ]
    positions = [500 + i for i in range(32)]
    alone = [sample(Sampler(0), logits[i : i + 1], rows[i : i + 1], positions[i : i + 1])[0].item() for i in range(32)]
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1)).tolist()
    extra = _logits(5, seed=3, vocab=49152)
    batch = torch.cat([extra, logits[perm]]).cuda()
    mixed = [Sampling(), Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.2, seed=9), Sampling(0.9, min_p=0.1)]
    tokens, _ = sample(Sampler(7), batch, mixed + [rows[i] for i in perm], [1] * 5 + [positions[i] for i in perm])
    assert tokens[5:].tolist() == [alone[i] for i in perm]
