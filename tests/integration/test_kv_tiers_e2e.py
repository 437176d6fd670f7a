"""The second KV tier through real processes: a worker with a file-backed offload
pool (--kv-offload-dir) under a block pool too small for the working set, so
conversations' contexts are evicted, copied down, and copied back up on their
next turn. Greedy tokens equal transformers' (fp32) when served from tier 2,
with chunked prefill and preemption, and after the worker restarts (its tier 2
is gone: recomputed, never stale). The scheduler's audit of both tiers, run
whenever it goes idle, must never fail. The 12-block tests share one worker, each
with a scheduler of its own: the scheduler indexes both tiers, so a new one finds
them empty whatever an earlier test left in the worker's pool."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from proto import serving_pb2
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, load_model, scheduler_of, wait_idle
from tests.helpers.procs import Cluster, ServiceProcess
from tests.helpers.recorder import wait_for

MODEL = tiny_checkpoint("llama")
rng = random.Random(41)
# Six conversations of three full 16-token blocks of context each: 18 blocks, over a
# 12-block first tier. Each turn adds two tokens of its own.
CONTEXTS = [[rng.randrange(4, 700) for _ in range(48)] for _ in range(6)]
TURNS = [[[rng.randrange(4, 700) for _ in range(2)] for _ in CONTEXTS] for _ in range(2)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference():
    return load_model(MODEL)


def tiered_args(tmp_path, num_blocks: int) -> list[str]:
    """A worker's flags: `num_blocks` over a 64-block second tier in files under tmp_path."""
    tier_two = ["--kv-offload-blocks", "64", "--kv-offload-dir", str(tmp_path)]
    return ["--dtype", "float32", "--num-blocks", str(num_blocks), *tier_two]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """12 blocks over a 64-block second tier, for the tests below that use that pool."""
    args = ["--model", str(MODEL), *tiered_args(tmp_path_factory.mktemp("tier2"), 12)]
    with ServiceProcess("worker_svc", args) as proc:
        yield proc


def tiered(worker: ServiceProcess, *scheduler_args: str):
    """(scheduler, client): a scheduler of the test's own in front of the shared worker."""
    return scheduler_of(MODEL, [worker], "--health-interval-s", "0.2", *scheduler_args)


def turn(client: SchedulerClient, index: int, concurrent: bool = False, max_tokens: int = MAX_TOKENS):
    prompts = [context + TURNS[index][i] for i, context in enumerate(CONTEXTS)]

    def one(ids):
        return client.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, timeout=120)

    if not concurrent:
        return prompts, [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return prompts, list(pool.map(one, prompts))


def assert_exact(reference, prompts, results, max_tokens: int = MAX_TOKENS) -> None:
    for ids, got in zip(prompts, results):
        assert got.token_ids == hf_greedy(reference, ids, max_tokens)


def assert_clean(scheduler: ServiceProcess) -> None:
    """Idle past a health interval (0.2 s), the scheduler has audited both tiers."""
    time.sleep(1.0)
    log = scheduler.log_path.read_text(errors="replace")
    for sign in ("Traceback", "engine audit failed", "worker rejected step"):
        assert sign not in log, log[-4000:]


def test_second_turns_are_served_from_tier_two_exactly(worker, reference):
    with tiered(worker) as (scheduler, client):
        first_prompts, first = turn(client, 0)
        spilled = wait_idle(client)
        prompts, second = turn(client, 1)
        stats = wait_idle(client)
        assert_clean(scheduler)
    assert_exact(reference, first_prompts, first)
    assert_exact(reference, prompts, second)
    assert [r.cached_prompt_tokens for r in first] == [0] * 6
    assert [r.cached_prompt_tokens for r in second] == [48] * 6
    # Turn 1: conversations 3, 4, 5 each evicted an earlier one's three cached blocks.
    assert (spilled.blocks_offloaded, spilled.offload_blocks_cached, spilled.blocks_onloaded) == (9, 9, 0)
    # Turn 2: each conversation evicts the one three behind it, so every context comes from tier 2.
    assert (stats.offload_hit_tokens, stats.blocks_onloaded) == (6 * 48, 6 * 3)
    assert stats.blocks_offloaded == 18  # the other nine went down during turn 2; no block twice
    assert stats.offload_blocks_total == 64 and stats.blocks_used == 0
    assert stats.offload_seconds > 0 and stats.onload_seconds > 0


def test_tier_two_with_chunked_prefill_and_preemption_stays_exact(tmp_path, reference):
    # Prompts of 50 tokens prefilled 16 at a time; two requests of four blocks fit the
    # nine, and a request's 90 tokens need six: whichever two run at once outgrow the nine
    # and one is preempted, however their arrivals are spread (with 20 tokens out, 5
    # blocks each, two admitted a few steps apart could both finish: seen once at load 12).
    chunked = ["--health-interval-s", "0.2", "--max-num-batched-tokens", "32", "--chunk-size", "16"]
    cluster = Cluster(MODEL, tiered_args(tmp_path, 9), chunked)
    with cluster, SchedulerClient(cluster.address) as client:
        turn(client, 0)
        wait_idle(client)
        prompts, second = turn(client, 1, concurrent=True, max_tokens=40)
        stats = wait_idle(client)
        assert cluster.scheduler is not None
        assert_clean(cluster.scheduler)
    assert_exact(reference, prompts, second, max_tokens=40)
    assert stats.preemptions > 0 and stats.offload_hit_tokens > 0
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_a_restarted_worker_lost_its_tier_two_so_contexts_are_recomputed(worker, reference):
    with tiered(worker) as (scheduler, client):
        turn(client, 0)
        assert wait_idle(client).offload_blocks_cached > 0
        worker.kill()
        worker.restart()  # the module's worker from here on: a new instance, both tiers empty
        wait_for(lambda: "worker restarted: prefix cache reset" in scheduler.log_path.read_text(), 30, "the restart")
        prompts, second = turn(client, 1)
        stats = wait_idle(client)
        assert_clean(scheduler)
    assert_exact(reference, prompts, second)
    assert [r.cached_prompt_tokens for r in second] == [0] * 6  # neither tier survived the restart
    assert stats.offload_blocks_cached > 0  # the new instance's tier 2 fills again


def test_pinning_a_prefix_that_lives_only_in_tier_two_copies_it_up_and_pins_it(worker, reference):
    share = ("--max-pin-share-per-key", "0.5")  # 3 of the 12 blocks, over the default share
    with tiered(worker, *share) as (scheduler, client):
        turn(client, 0)
        spilled = wait_idle(client)
        assert (spilled.blocks_offloaded, spilled.blocks_onloaded) == (9, 0)  # contexts 0, 1, 2 went down
        pin = client.stub.PinPrefix(serving_pb2.PinPrefixRequest(prompt_token_ids=CONTEXTS[0]), timeout=120)
        pinned = wait_idle(client)
        prompts, second = turn(client, 1)  # every other context passes through tier 1 around the pin
        stats = wait_idle(client)
        assert_clean(scheduler)
    assert (pin.pinned_tokens, pin.workers) == (48, 1)
    # Its three blocks were copied up, none computed: the pin's request ran one token.
    assert pinned.blocks_onloaded == 3 and pinned.tokens_computed - spilled.tokens_computed == 1
    assert pinned.blocks_pinned == 3
    assert_exact(reference, prompts, second)
    assert second[0].cached_prompt_tokens == 48  # from the pinned blocks, still in tier 1
    assert stats.blocks_pinned == 3
