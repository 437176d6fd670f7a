"""Overlapped (async) scheduling and strict alternation give the same tokens as
transformers: every tiny family, chunked prefill, prefix-cache hits, preemption,
n > 1 forks, two workers and the Triton path (under the interpreter)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import TINY_FAMILIES, tiny_checkpoint
from tests.helpers.cluster import hf_greedy, wait_idle
from tests.helpers.sweeps import sweep
from tools.processes import Cluster

MODES = {"async": [], "sync": ["--no-async-scheduling"]}
# 20 blocks of 16 for 16 requests of up to ~90 tokens: requests wait and get preempted.
SCHEDULER = ["--max-num-batched-tokens", "48", "--chunk-size", "32", "--max-num-seqs", "8"]
SHARED_PREFIX = list(range(300, 340))  # 40 tokens: two full blocks to hit in the prefix cache
# Four samples of 20 + 90 tokens need 1 shared + 4 x 6 own blocks > 20 whenever they
# run, so they preempt each other whatever the timing of the concurrent requests above.
CROWDING_PROMPT, CROWDING_SAMPLES, CROWDING_TOKENS = list(range(40, 60)), 4, 90


def _cases(seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(4, 700) for _ in range(rng.randrange(3, 70))], rng.randrange(4, 24)) for _ in range(16)]


def _check(cluster: Cluster, family: str, expect_preemption: bool) -> None:
    model_dir = tiny_checkpoint(family)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cases = _cases(len(family))
    with cluster, SchedulerClient(cluster.address) as client:

        def run(case: tuple[list[int], int]):
            ids, n = case
            return client.generate(prompt_token_ids=ids, max_tokens=n, temperature=0.0, timeout=120)

        with ThreadPoolExecutor(len(cases)) as pool:
            results = list(pool.map(run, cases))
        for (ids, n), got in zip(cases, results):
            assert got.token_ids == hf_greedy(ref, ids, n), f"{family}: prompt of {len(ids)} tokens"
        # The same prefix twice: the second request reads its first blocks from the cache.
        for tail in ([5, 6, 7], [8, 9]):
            got = client.generate(prompt_token_ids=SHARED_PREFIX + tail, max_tokens=6, temperature=0.0)
            assert got.token_ids == hf_greedy(ref, SHARED_PREFIX + tail, 6)
        assert got.cached_prompt_tokens >= 32
        # Two greedy samples fork off one computed prompt: both are the greedy continuation.
        prompt, samples = cases[0][0] + [11, 12], {0: [], 1: []}
        for reply in client.stream(prompt_token_ids=prompt, max_tokens=7, temperature=0.0, n=2):
            samples[reply.index].extend(reply.token_ids)
        assert samples[0] == samples[1] == hf_greedy(ref, prompt, 7)
        if expect_preemption:
            _check_crowded_forks(client, ref)
        stats = wait_idle(client)
    if expect_preemption:
        assert stats.preemptions > 0, "the pool was meant to force preemption"
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def _check_crowded_forks(client: SchedulerClient, ref) -> None:
    before = client.stats().preemptions
    samples: dict[int, list[int]] = {i: [] for i in range(CROWDING_SAMPLES)}
    replies = client.stream(
        prompt_token_ids=CROWDING_PROMPT,
        max_tokens=CROWDING_TOKENS,
        temperature=0.0,
        n=CROWDING_SAMPLES,
        ignore_eos=True,
        timeout=120,
    )
    for reply in replies:
        samples[reply.index].extend(reply.token_ids)
    expected = hf_greedy(ref, CROWDING_PROMPT, CROWDING_TOKENS, ignore_eos=True)
    assert all(tokens == expected for tokens in samples.values())
    assert client.stats().preemptions > before, "samples that outgrow the pool must preempt each other"


# The mode is the scheduler's, the family the worker's: they meet in few places (the
# scheduler has no per-family path), and every family meets transformers in process in
# `make test` (test_chunked_prefill.py), gemma3's sliding windows over gRPC too
# (test_worker_exactness.py). `make test` keeps llama in the default (async) mode and
# qwen3_mqa (one KV head, q/k norms) in the other; the other families and modes are
# `make test-slow`'s.
FAMILY_MODES = sweep(
    [(f, m) for m in MODES for f in TINY_FAMILIES],
    keep=[("llama", "async"), ("qwen3_mqa", "sync")],
)


@pytest.mark.parametrize(("family", "mode"), FAMILY_MODES)
def test_every_family_is_token_exact_in_both_modes(family, mode):
    cluster = Cluster(tiny_checkpoint(family), ["--dtype", "float32", "--num-blocks", "20"], SCHEDULER + MODES[mode])
    _check(cluster, family, expect_preemption=True)


@pytest.mark.parametrize("mode", sweep(MODES, keep=["async"]))  # sync: one worker above
def test_two_workers_in_both_modes(mode):
    cluster = Cluster(
        tiny_checkpoint("llama"), ["--dtype", "float32", "--num-blocks", "64"], SCHEDULER + MODES[mode], num_workers=2
    )
    _check(cluster, "llama", expect_preemption=False)


# The interpreter runs every kernel in Python (~90 s a mode on 2 cores): `make
# test-slow`'s. In `make test` the Triton kernels meet their torch references one by
# one and as a worker's backend (tests/unit/test_triton_kernels.py).
@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_triton_path_under_the_interpreter_in_both_modes(mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the workers inherit it
    cluster = Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", "20", "--attention-backend", "triton"],
        SCHEDULER + MODES[mode],
    )
    _check(cluster, "llama", expect_preemption=True)
