"""The C++ argmax_logsumexp (kernels/csrc/sampling_cpu.cpp) against the reference, the
oracle: the same argmax (ties to the first index), the log-sum-exp within fp32 rounding
of the exact (float64) value, NaN and infinities as torch gives them, strided rows, and
the sampler's tokens and logprobs through it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import cpu_ops, reference
from tests.helpers.worker_steps import Sampling, sample
from worker_svc.sampling.sampler import Sampler

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C++ CPU kernel could not be built here")


def exact_lse(x: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.double(), dim=-1)


@pytest.mark.parametrize("shape", [(1, 49152), (32, 49152), (5, 1), (3, 17), (4, 257), (2, 1000)])
def test_argmax_and_logsumexp_match_the_reference(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 6
    index, lse = cpu_ops.argmax_logsumexp(x)
    want_index, want_lse = reference.argmax_logsumexp(x)
    assert index.dtype == torch.int64 and lse.dtype == torch.float32
    assert torch.equal(index, want_index)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)
    # as close to the exact value as torch's own sum is, within an ulp or two
    ulp = torch.finfo(torch.float32).eps * exact_lse(x).abs().clamp(min=1)
    assert ((lse.double() - exact_lse(x)).abs() <= 4 * ulp).all()


def test_ties_go_to_the_first_index_as_torch_argmax():
    x = torch.zeros(3, 100)
    x[0, [7, 40, 99]] = 2.0  # three equal maxima in different vector lanes
    x[1, [33, 34]] = 1.0
    # row 2: every logit equal
    index, lse = cpu_ops.argmax_logsumexp(x)
    assert index.tolist() == [7, 33, 0] == reference.argmax_logsumexp(x)[0].tolist()
    torch.testing.assert_close(lse[2], torch.tensor(np.log(100.0), dtype=torch.float32))


def test_nan_and_infinities_as_torch():
    x = torch.randn(5, 300)
    x[0, 123] = float("nan")  # NaN wins the argmax and makes the sum NaN
    x[1] = -float("inf")  # every token masked
    x[2, 77] = float("inf")
    x[3, :290] = -float("inf")  # masked tokens beside finite ones (the tail past the vectors)
    index, lse = cpu_ops.argmax_logsumexp(x)
    want_index, want_lse = reference.argmax_logsumexp(x)
    assert torch.equal(index, want_index)
    torch.testing.assert_close(lse, want_lse, equal_nan=True)


def test_strided_rows_and_other_dtypes_take_the_right_path():
    wide = torch.randn(4, 64)
    view = wide[:, ::2]  # rows not contiguous: copied first
    torch.testing.assert_close(cpu_ops.argmax_logsumexp(view)[1], reference.argmax_logsumexp(view)[1])
    assert torch.equal(cpu_ops.argmax_logsumexp(view)[0], view.argmax(dim=-1))
    half = torch.randn(2, 50).to(torch.bfloat16)  # not fp32: the reference's
    assert torch.equal(cpu_ops.argmax_logsumexp(half)[0], half.argmax(dim=-1))
    empty = torch.zeros(0, 10)
    index, lse = cpu_ops.argmax_logsumexp(empty)
    assert index.shape == lse.shape == (0,)


def test_the_sampler_takes_its_tokens_and_logprobs_through_it():
    logits = torch.randn(6, 4096, generator=torch.Generator().manual_seed(3)) * 4
    params = [Sampling()] * 4 + [Sampling(0.7, seed=1), Sampling(1.0, top_k=20, seed=2)]
    tokens, logprobs = sample(Sampler(0), logits, params, list(range(6)))
    assert tokens[:4].tolist() == logits[:4].argmax(dim=-1).tolist()
    want = torch.log_softmax(logits.double(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), want, rtol=1e-6, atol=1e-6)
