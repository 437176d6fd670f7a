"""Scheduler + worker as real processes: concurrent greedy streams are
token-exact with transformers even when the pool forces chunking and preemption."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, wait_idle
from tests.helpers.procs import Cluster

# paged: 20 blocks x 16 = 320 token slots for 16 requests of up to ~90 tokens each:
# requests must wait, get preempted and recompute. contiguous: 3 slots of 128
# tokens, one per sequence for its life: requests wait for a free slot (no
# preemption: a running sequence never needs more memory).
KV_LAYOUTS = {
    "paged": ["--num-blocks", "20"],
    "contiguous": ["--kv-layout", "contiguous", "--max-batch", "3", "--max-model-len", "128"],
}


@pytest.mark.parametrize("layout", list(KV_LAYOUTS))
def test_concurrent_greedy_streams_match_transformers_under_chunking_and_preemption(layout):
    model_dir = tiny_checkpoint("llama")
    # A 48-token budget with 32-token chunks splits every longer prompt.
    cluster = Cluster(
        model_dir,
        ["--dtype", "float32", *KV_LAYOUTS[layout]],
        ["--max-num-batched-tokens", "48", "--chunk-size", "32", "--max-num-seqs", "8"],
    )
    rng = random.Random(0)
    cases = [([rng.randrange(4, 700) for _ in range(rng.randrange(3, 70))], rng.randrange(4, 24)) for _ in range(16)]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = [hf_greedy(ref, ids, n) for ids, n in cases]
    with cluster, SchedulerClient(cluster.address) as client:

        def run(case):
            ids, n = case
            return client.generate(prompt_token_ids=ids, max_tokens=n, temperature=0.0, timeout=120)

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(run, cases))
        stats = wait_idle(client)

    for (ids, n), want, got in zip(cases, expected, results):
        assert got.token_ids == want, f"prompt of {len(ids)} tokens, max_tokens {n}"
        assert got.completion_tokens == len(want) and got.prompt_tokens == len(ids)
        assert got.finish_reason == ("length" if len(want) == n else "stop")
    if layout == "paged":
        assert stats.preemptions > 0, "the pool was meant to force preemption"
    else:
        assert stats.blocks_total == 3 and stats.preemptions == 0  # the scheduler accounts in slots
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
    assert stats.requests_finished == 16


def test_default_model_streams_the_transformers_greedy_text(default_model):
    tokenizer = AutoTokenizer.from_pretrained(default_model)
    ref = AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    prompt = "The capital of France is"
    want_ids = hf_greedy(ref, tokenizer(prompt).input_ids, 24)
    with Cluster(default_model, ["--dtype", "float32", "--num-blocks", "64"]) as cluster:
        with SchedulerClient(cluster.address) as client:
            pieces = list(client.stream(prompt, max_tokens=24, temperature=0.0, timeout=120))
    assert [t for r in pieces for t in r.token_ids] == want_ids
    assert "".join(r.text for r in pieces) == tokenizer.decode(want_ids, skip_special_tokens=True)
    assert pieces[-1].finished and pieces[-1].usage.prompt_tokens == 5
