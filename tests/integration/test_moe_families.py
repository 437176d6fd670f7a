"""The mixture-of-experts families (Qwen3-MoE with a dense layer and unnormalised
top-k weights, Mixtral with a sliding window), built tiny by
tools/tiny_checkpoints.py, through a real scheduler and worker: greedy tokens equal
transformers' (fp32) with prefix caching, chunked prefill, preemption and n-gram
speculative decoding in the mix, on the C++ MoE kernel (the CPU's fused forward)
and on the torch reference; and with tensor parallelism over two ranks (gloo),
each expert split over its width."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import MOE_FAMILIES, tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, hf_greedy, wait_idle
from tests.helpers.procs import Cluster
from tests.helpers.sweeps import sweep

rng = random.Random(38)
SYSTEMS = [[rng.randrange(4, 700) for _ in range(40)] for _ in range(2)]
# Repeated motifs in some prompts, so the n-gram drafter proposes (and mostly fails).
CASES = [(SYSTEMS[i % 2] + [rng.randrange(4, 700) for _ in range(3)] * (1 + i % 3), 8 + 2 * i) for i in range(8)]
WORKER = ["--dtype", "float32", "--num-blocks", "12"]
SCHEDULER = ["--max-num-batched-tokens", "64", "--chunk-size", "32"]


def generate_all(cluster: Cluster) -> tuple[list[list[int]], object]:
    with SchedulerClient(cluster.address) as client:
        first = client.generate(prompt_token_ids=CASES[0][0], max_tokens=CASES[0][1], temperature=0.0, timeout=120)

        def one(case: tuple[list[int], int]):
            ids, n = case
            return client.generate(prompt_token_ids=ids, max_tokens=n, temperature=0.0, timeout=120)

        with ThreadPoolExecutor(len(CASES) - 1) as pool:
            rest = list(pool.map(one, CASES[1:]))
        return [r.token_ids for r in [first, *rest]], wait_idle(client)


# `make test` keeps Qwen3-MoE on the C++ kernel with drafts and Mixtral split over two
# ranks; the other four cases (each family on the reference ops, the other split) are slow.
@pytest.mark.parametrize(
    ("family", "worker", "scheduler"),
    sweep(
        [
            *[(f, [], [*SCHEDULER, *SPEC_FLAGS]) for f in MOE_FAMILIES],  # C++ kernel, with drafts
            *[(f, ["--attention-backend", "torch"], SCHEDULER) for f in MOE_FAMILIES],  # the reference
            *[(f, ["--tensor-parallel-size", "2"], SCHEDULER) for f in MOE_FAMILIES],  # experts split in two
        ],
        keep=[("qwen3_moe", [], [*SCHEDULER, *SPEC_FLAGS]), ("mixtral", ["--tensor-parallel-size", "2"], SCHEDULER)],
        ids=[f"{f}-{mode}" for mode in ("cpu-spec", "torch", "tp2") for f in MOE_FAMILIES],
    ),
)
def test_greedy_tokens_equal_transformers(family, worker, scheduler):
    model_dir = tiny_checkpoint(family)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with Cluster(model_dir, [*WORKER, *worker], scheduler) as cluster:
        got, stats = generate_all(cluster)
    for (ids, n), tokens in zip(CASES, got):
        assert tokens == hf_greedy(ref, ids, n), f"{family}: prompt of {len(ids)}"
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.preemptions > 0
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
