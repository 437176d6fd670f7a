"""Pooling rows on the worker (worker.v1 SeqColumns.pooling): a row's chunk
reduced to its last position's hidden state or the sum over its positions, the
last layer after the final norm, equal to transformers' last_hidden_state in
fp32, on the tiny models and the default model; mixed in one step with sampling rows, over chunks, and refused where the
row cannot pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import DEFAULT_MODEL, tiny_checkpoint
from worker_svc.config import WorkerConfig
from worker_svc.runner.pooling import POOLING_LAST, POOLING_SUM
from worker_svc.step.builder import StepBuilder
from worker_svc.step.errors import InvalidStep
from worker_svc.worker import Worker

BLOCK = 16


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3", "default"])
def pair(request):
    model = str(DEFAULT_MODEL if request.param == "default" else tiny_checkpoint(request.param))
    worker = Worker(WorkerConfig(model=model, dtype="float32", num_blocks=32))
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return worker, ref


def hidden_states(ref, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return ref.model(torch.tensor([ids])).last_hidden_state[0].numpy()


def assert_same_direction(got: np.ndarray, want: np.ndarray) -> None:
    """What an embedding is made of: equal once normalised within 1e-5, cosine >= 0.99999
    (the raw states of the default model reach ~30, where fp32 round-off alone is ~1e-5)."""
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_allclose(got / np.linalg.norm(got), want / np.linalg.norm(want), atol=1e-5)
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) >= 0.99999
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_pooled_rows_equal_transformers_over_chunks_beside_a_sampling_row(pair):
    worker, ref = pair
    vocab = worker.info.vocab_size
    g = np.random.default_rng(0)
    prompt, other = g.integers(3, vocab, 37).tolist(), g.integers(3, vocab, 9).tolist()
    want = hidden_states(ref, prompt)
    # Step 1: the first 20 tokens summed (one row) and the other prompt sampled beside them.
    step = (
        StepBuilder(BLOCK)
        .add(1, prompt[:20], 0, [3, 7], pooling=POOLING_SUM)
        .add(2, other, 0, [5], sample=True)
        .build(1)
    )
    out = worker.step(step)
    assert out.pooled is not None and out.pooled.seq_ids.tolist() == [1]
    assert out.samples.seq_ids.tolist() == [2]
    assert_same_direction(out.pooled.values[0], want[:20].sum(0))
    # Step 2: the rest over the cached context, pooled both ways (two sequences, same tokens).
    step = (
        StepBuilder(BLOCK)
        .add(1, prompt[20:], 20, [3, 7, 9], pooling=POOLING_SUM)
        .add(3, prompt, 0, [10, 11, 12], pooling=POOLING_LAST)
        .build(2)
    )
    out = worker.step(step)
    assert out.pooled is not None and out.pooled.seq_ids.tolist() == [1, 3]
    assert_same_direction(out.pooled.values[0], want[20:].sum(0))
    assert_same_direction(out.pooled.values[1], want[-1])
    assert not out.samples.seq_ids.size


def test_a_step_without_pooling_rows_pools_nothing(pair):
    worker, _ = pair
    out = worker.step(StepBuilder(BLOCK).add(1, [5, 6, 7], 0, [2], sample=True).build(1))
    assert out.pooled is None


def test_unknown_pooling_is_refused_naming_the_row(pair):
    worker, _ = pair
    with pytest.raises(InvalidStep, match=r"seqs\.pooling\[row 1\].*unknown pooling 7"):
        worker.step(StepBuilder(BLOCK).add(1, [5], 0, [2]).add(2, [6], 0, [3], pooling=7).build(1))
