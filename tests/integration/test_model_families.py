"""Every dense family beyond Llama/Qwen3/Gemma3, built tiny by tools/tiny_checkpoints.py,
through a real scheduler and worker: greedy tokens equal transformers' (fp32) with
prefix caching, chunked prefill, block eviction and preemption in the mix."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import DENSE_FAMILIES, tiny_checkpoint
from tests.helpers.cluster import hf_greedy, wait_idle
from tests.helpers.procs import Cluster
from tests.helpers.sweeps import sweep

rng = random.Random(37)
SYSTEMS = [[rng.randrange(4, 700) for _ in range(40)] for _ in range(2)]
# 40-token shared systems + 5..23 own tokens, 10..28 generated: within the tiny Phi-3's
# original context (128), where longrope is served (worker_svc/models/rope.py).
CASES = [(SYSTEMS[i % 2] + [rng.randrange(4, 700) for _ in range(5 + 2 * i)], 10 + 2 * i) for i in range(10)]


# Every family meets transformers in process in `make test` (test_chunked_prefill.py); through
# real services, `make test` keeps the biased Llama (the case that once loaded silently wrong)
# and Gemma 2 (alternating sliding windows, soft-capping); the rest are `make test-slow`'s.
@pytest.mark.parametrize("family", sweep(DENSE_FAMILIES, keep=("llama_bias", "gemma2")))
def test_greedy_tokens_equal_transformers_under_preemption_and_prefix_caching(family):
    model_dir = tiny_checkpoint(family)
    # Eager attention: transformers' SDPA path would drop Gemma 2's score soft-cap.
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with (
        Cluster(
            model_dir,
            ["--dtype", "float32", "--num-blocks", "14"],
            ["--max-num-batched-tokens", "64", "--chunk-size", "32"],
        ) as cluster,
        SchedulerClient(cluster.address) as client,
    ):
        first = client.generate(prompt_token_ids=CASES[0][0], max_tokens=CASES[0][1], temperature=0.0, timeout=60)

        def one(case: tuple[list[int], int]):
            ids, n = case
            return client.generate(prompt_token_ids=ids, max_tokens=n, temperature=0.0, timeout=60)

        with ThreadPoolExecutor(len(CASES) - 1) as pool:
            rest = list(pool.map(one, CASES[1:]))
        stats = wait_idle(client)
    for (ids, n), got in zip(CASES, [first, *rest]):
        assert got.token_ids == hf_greedy(ref, ids, n), f"{family}: prompt of {len(ids)}"
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.preemptions > 0
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
