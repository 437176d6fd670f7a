"""Worker.Step over real gRPC vs transformers on the same checkpoint (fp32).

Each family (make test keeps four, WORKER_FAMILIES) runs: a one-step prefill, the
same prompt in uneven chunks that cross block boundaries, then greedy decode steps,
all on random non-contiguous block tables; logits at every sampled position must
match transformers' forward.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.helpers.checkpoints import TINY_FAMILIES, tiny_checkpoint
from tests.helpers.sweeps import sweep
from tests.helpers.worker_client import by_seq, logits_of, seq_step
from tests.helpers.worker_under_test import NUM_BLOCKS, WorkerUnderTest

TINY_ATOL = 1e-4
# SmolLM2 has 30 layers and a 49k vocab; fp32 reordering across them measured
# ~5e-5 max abs error, so 1e-3 leaves room without hiding a real bug (a wrong
# mask or rope shows up as errors of order 1).
DEFAULT_MODEL_ATOL = 1e-3


# A worker process per family: make test keeps llama (llama3 rope, GQA), qwen3_mqa
# (q/k norms, one KV head), gemma3 (sliding windows) and the real default model; the
# other tiny families repeat those paths over gRPC, and their forward is checked
# against transformers in process by test_chunked_prefill.py in every make test.
WORKER_FAMILIES = sweep(TINY_FAMILIES + ("default",), keep=("llama", "qwen3_mqa", "gemma3", "default"))


@pytest.fixture(scope="module", params=WORKER_FAMILIES)
def worker(request, default_model):
    if request.param == "default":
        w = WorkerUnderTest(default_model, DEFAULT_MODEL_ATOL)
    else:
        w = WorkerUnderTest(tiny_checkpoint(request.param), TINY_ATOL)
    yield w
    w.close()


def prompt_for(worker: WorkerUnderTest, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, worker.info.vocab_size) for _ in range(n)]


def random_table(n_blocks: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(NUM_BLOCKS), n_blocks)


def assert_close(ours: np.ndarray, ref: np.ndarray, atol: float):
    err = float(np.abs(ours - ref).max())
    assert err <= atol, f"max |logit error| {err:.2e} > {atol:.0e}"
    assert int(ours.argmax()) == int(ref.argmax())


def test_prefill_chunks_and_decode_match_transformers(worker):
    # 40 tokens: past Gemma's sliding window (8) and across 3 blocks.
    prompt = prompt_for(worker, 40)
    ref = worker.ref_logits(prompt)

    one = by_seq(worker.step([seq_step(1, prompt, 0, random_table(4, 1))]))[1]
    assert_close(logits_of(one), ref[-1], worker.atol)

    table = random_table(6, 2)
    pos = 0
    for chunk in (5, 16, 11, 8):
        out = by_seq(worker.step([seq_step(2, prompt[pos : pos + chunk], pos, table)]))[2]
        pos += chunk
        assert_close(logits_of(out), ref[pos - 1], worker.atol)

    tokens = list(prompt)
    next_token = out.token_id
    for _ in range(10):
        tokens.append(next_token)
        out = by_seq(worker.step([seq_step(2, [next_token], len(tokens) - 1, table)]))[2]
        assert_close(logits_of(out), worker.ref_logits(tokens)[-1], worker.atol)
        next_token = out.token_id
    tokens.append(next_token)

    expected = worker.ref.generate(torch.tensor([prompt]), max_new_tokens=11, do_sample=False, min_new_tokens=11)
    assert tokens == expected[0].tolist()


def test_mixed_step_equals_each_sequence_alone(worker):
    prompts = [prompt_for(worker, n, seed=10 + n) for n in (3, 17, 33, 20)]
    # Disjoint blocks per run, so the two runs cannot see each other's cache.
    blocks = random_table(32, 100)
    alone_tables = [blocks[4 * i : 4 * i + 4] for i in range(4)]
    mixed_tables = [blocks[16 + 4 * i : 16 + 4 * i + 4] for i in range(4)]

    def run(tbls, together: bool, id_base: int):
        # Phase 1: seq 0 and 1 fully prefilled; seq 2 gets its first 16 tokens.
        phase1 = [
            seq_step(id_base + 0, prompts[0], 0, tbls[0]),
            seq_step(id_base + 1, prompts[1], 0, tbls[1]),
            seq_step(id_base + 2, prompts[2][:16], 0, tbls[2], sample=False, logits=False),
        ]
        results = {}
        for group in [phase1] if together else [[s] for s in phase1]:
            results.update(by_seq(worker.step(group)))
        # Phase 2, one step: decodes of 0 and 1, seq 2's remaining chunk, seq 3's whole prompt.
        phase2 = [
            seq_step(id_base + 0, [results[id_base + 0].token_id], 3, tbls[0]),
            seq_step(id_base + 1, [results[id_base + 1].token_id], 17, tbls[1]),
            seq_step(id_base + 2, prompts[2][16:], 16, tbls[2]),
            seq_step(id_base + 3, prompts[3], 0, tbls[3]),
        ]
        out = {}
        for group in [phase2] if together else [[s] for s in phase2]:
            out.update(by_seq(worker.step(group)))
        return [out[id_base + i] for i in range(4)]

    alone = run(alone_tables, together=False, id_base=100)
    mixed = run(mixed_tables, together=True, id_base=200)
    for a, m in zip(alone, mixed):
        assert a.token_id == m.token_id
        np.testing.assert_allclose(logits_of(m), logits_of(a), atol=worker.atol, rtol=0)


def test_block_copy_then_decode_from_the_copy(worker):
    prompt = prompt_for(worker, 20, seed=7)
    src_table, dst_table = [40, 41], [42, 43]
    first = by_seq(worker.step([seq_step(7, prompt, 0, src_table)]))[7]
    copied = worker.step([], copies=[(40, 42), (41, 43)])
    assert not by_seq(copied)
    from_src = by_seq(worker.step([seq_step(7, [first.token_id], 20, src_table)]))[7]
    from_copy = by_seq(worker.step([seq_step(8, [first.token_id], 20, dst_table)]))[8]
    np.testing.assert_array_equal(logits_of(from_copy), logits_of(from_src))


def test_seeded_sampling_is_reproducible(worker):
    prompt = prompt_for(worker, 9, seed=3)
    draws = []
    for seq_id, table in ((20, [50]), (21, [51])):
        out = by_seq(worker.step([seq_step(seq_id, prompt, 0, table, temperature=1.0, seed=1234, logits=False)]))
        draws.append(out[seq_id].token_id)
    assert draws[0] == draws[1]
    unseeded_differs = {
        by_seq(worker.step([seq_step(22, prompt, 0, [52], temperature=5.0, logits=False)]))[22].token_id
        for _ in range(8)
    }
    assert len(unseeded_differs) > 1
