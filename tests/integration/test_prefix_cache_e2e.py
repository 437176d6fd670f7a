"""Prefix caching, parallel samples and pinning through real processes, with
greedy tokens checked against transformers. The tests whose pool size does not
matter share one worker, each with a scheduler of its own (a new scheduler knows
none of the worker's blocks: nothing cached carries over); the tight-pool and long
tests start their own."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from proto import serving_pb2
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, scheduler_of, wait_idle
from tests.helpers.procs import Cluster, ServiceProcess

MODEL = tiny_checkpoint("llama")
rng = random.Random(4)
SYSTEMS = [[rng.randrange(4, 700) for _ in range(40)] for _ in range(2)]
CASES = [(SYSTEMS[i % 2] + [rng.randrange(4, 700) for _ in range(3 + i)], 6 + i) for i in range(6)]


@pytest.fixture(scope="module")
def reference():
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    return lambda ids, n: hf_greedy(model, ids, n)


@pytest.fixture(scope="module")
def worker():
    """tiny llama, 64 blocks: room for every request of the tests that share it."""
    args = ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "64"]
    with ServiceProcess("worker_svc", args) as proc:
        yield proc


def run_all(client, cases, concurrent=True):
    def one(case):
        ids, n = case
        return client.generate(prompt_token_ids=ids, max_tokens=n, temperature=0.0, timeout=60)

    if not concurrent:
        return [one(c) for c in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(one, cases))


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
def test_greedy_tokens_with_and_without_prefix_caching_equal_transformers(caching, reference, worker):
    flags = [] if caching else ["--no-prefix-caching"]
    with scheduler_of(MODEL, [worker], *flags) as (_, client):
        first = run_all(client, CASES[:2], concurrent=False)  # computes both system prompts
        rest = run_all(client, CASES[2:])
        stats = wait_idle(client)
    for (ids, n), got in zip(CASES, first + rest):
        assert got.token_ids == reference(ids, n)
    cached = [r.cached_prompt_tokens for r in rest]
    assert cached == ([32] * 4 if caching else [0] * 4)  # two full 16-token blocks of each 40-token system prompt
    assert stats.prefix_cache_hit_tokens == (4 * 32 if caching else 0)
    assert stats.blocks_used == 0


def test_parallel_greedy_samples_fork_from_a_shared_partial_block(reference, worker):
    prompt = SYSTEMS[0][:21]  # the fork parent computes 20 tokens: one full block and 4 in a shared one
    with scheduler_of(MODEL, [worker]) as (_, client):
        replies = list(client.stream(prompt_token_ids=prompt, max_tokens=8, temperature=0.0, n=4, timeout=60))
        stats = wait_idle(client)
    want = reference(prompt, 8)
    for index in range(4):
        mine = [r for r in replies if r.index == index]
        assert [t for r in mine for t in r.token_ids] == want
        assert [r.finished for r in mine].count(True) == 1 and mine[-1].finished
        assert mine[-1].usage.prompt_tokens == 21 and mine[-1].usage.completion_tokens == 8
    assert stats.blocks_used == 0 and stats.requests_finished == 4
    # Only the parent's 20 tokens, then each sample's own last prompt token and decodes.
    assert stats.tokens_computed == 20 + 4 * 8


def test_seeded_parallel_samples_are_distinct_and_reproducible(worker):
    with scheduler_of(MODEL, [worker]) as (_, client):

        def samples():
            replies = client.stream(
                prompt_token_ids=SYSTEMS[1][:30],
                max_tokens=10,
                temperature=1.0,
                seed=11,
                n=3,
                ignore_eos=True,
                timeout=60,
            )
            by_index = {}
            for r in replies:
                by_index.setdefault(r.index, []).extend(r.token_ids)
            return [by_index[i] for i in range(3)]

        first, second = samples(), samples()
    assert first == second
    assert len({tuple(s) for s in first}) == 3


def test_tight_pool_with_shared_prefixes_evicts_preempts_and_stays_exact(reference):
    cases = [(SYSTEMS[i % 2] + [rng.randrange(4, 700) for _ in range(5 + 3 * i)], 10 + 2 * i) for i in range(10)]
    with (
        Cluster(
            tiny_checkpoint("llama"),
            ["--dtype", "float32", "--num-blocks", "14"],
            ["--max-num-batched-tokens", "64", "--chunk-size", "32"],
        ) as cluster,
        SchedulerClient(cluster.address) as client,
    ):
        results = run_all(client, cases)
        stats = wait_idle(client)
    for (ids, n), got in zip(cases, results):
        assert got.token_ids == reference(ids, n)
    assert stats.evictions > 0 and stats.preemptions > 0
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_cached_1000_token_prefix_sends_only_the_tail():
    prefix = [rng.randrange(4, 700) for _ in range(1000)]
    with (
        Cluster(tiny_checkpoint("llama_long"), ["--dtype", "float32", "--num-blocks", "256"]) as cluster,
        SchedulerClient(cluster.address) as client,
    ):
        client.generate(prompt_token_ids=prefix + [5, 6, 7], max_tokens=1, temperature=0.0)
        before = client.stats().tokens_computed
        second = client.generate(prompt_token_ids=prefix + [8, 9, 10, 11], max_tokens=1, temperature=0.0)
        computed = client.stats().tokens_computed - before
    assert second.cached_prompt_tokens == 992  # 62 full blocks of the prefix
    assert computed == 1004 - 992


def test_pinned_prefix_is_never_evicted_and_pins_are_capped():
    system = SYSTEMS[0]  # 40 tokens: 2 full blocks get pinned
    with (
        Cluster(
            tiny_checkpoint("llama"),
            ["--dtype", "float32", "--num-blocks", "12"],
            # the pool-wide cap under test, not one key's share (test_hardening.py)
            ["--max-pinned-blocks", "3", "--max-pin-share-per-key", "1"],
        ) as cluster,
        SchedulerClient(cluster.address) as client,
    ):
        pin = client.stub.PinPrefix(serving_pb2.PinPrefixRequest(prompt_token_ids=system))
        assert (pin.pinned_tokens, pin.workers) == (32, 1)
        # Fill the pool with unrelated prompts over and over: every unpinned cached block is evicted.
        run_all(client, [([600 + i] * 150, 2) for i in range(4)], concurrent=False)
        assert client.stats().evictions > 0 and client.stats().blocks_pinned == 2
        hit = client.generate(prompt_token_ids=system + [9, 9], max_tokens=2, temperature=0.0)
        assert hit.cached_prompt_tokens == 32
        with pytest.raises(grpc.RpcError) as err:
            client.stub.PinPrefix(serving_pb2.PinPrefixRequest(prompt_token_ids=SYSTEMS[1] + [1] * 8))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.stub.UnpinPrefix(serving_pb2.UnpinPrefixRequest(pin_id=pin.pin_id)).unpinned
        stats = wait_idle(client)
    assert stats.blocks_pinned == 0 and stats.blocks_used == 0
