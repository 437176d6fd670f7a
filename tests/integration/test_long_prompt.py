"""A 20,000-token prompt prefilled in chunks while 8 streams decode: the decodes
never stall, progress arrives in order up to the total, the answer equals
transformers; cancelling a long prefill frees its blocks. Both tests share one
worker, each with a scheduler of its own."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, scheduler_of, wait_idle
from tests.helpers.procs import ServiceProcess

MODEL = tiny_checkpoint("llama_long")
LONG = 20_000
BUDGET = 2048


@pytest.fixture(scope="module")
def worker():
    with ServiceProcess("worker_svc", ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "1400"]) as proc:
        yield proc


def steps_from_log(text: str) -> list[list[str]]:
    steps = []
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "step":
            steps.append(entry["request_ids"])
    return steps


def test_long_prefill_interleaves_with_decodes_and_matches_transformers(worker):
    rng = random.Random(3)
    long_prompt = [rng.randrange(4, 700) for _ in range(LONG)]
    flags = ["--max-num-batched-tokens", str(BUDGET), "--max-model-len", "32768", "--log-level", "debug"]
    with scheduler_of(MODEL, [worker], *flags, "--log-format", "json") as (scheduler, client):
        decodes, results = [], {}

        def decode(i):
            results[i] = client.generate(
                prompt_token_ids=[10 + i] * 8,
                max_tokens=60,
                temperature=0.0,
                ignore_eos=True,
                request_id=f"d{i}",
                timeout=120,
            )

        for i in range(8):
            decodes.append(threading.Thread(target=decode, args=(i,)))
            decodes[-1].start()
        deadline = time.monotonic() + 30
        while client.stats().running < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        long = client.generate(
            prompt_token_ids=long_prompt, max_tokens=3, temperature=0.0, request_id="long", timeout=120
        )
        for t in decodes:
            t.join(120)
        stats = wait_idle(client)
        log = scheduler.log_path.read_text()

    ref = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assert long.token_ids == hf_greedy(ref, long_prompt, 3)
    processed = [p for p, _ in long.progress]
    assert processed == sorted(processed) and long.progress[-1] == (LONG, LONG) and len(long.progress) >= LONG // BUDGET
    assert all(total == LONG for _, total in long.progress)
    assert all(len(r.token_ids) == 60 for r in results.values())

    steps = steps_from_log(log)
    with_long = [i for i, ids in enumerate(steps) if "long" in ids]
    assert len(with_long) >= LONG // BUDGET
    window = steps[with_long[0] : with_long[-1] + 1]
    for i in range(8):
        rid = f"d{i}"
        running = [rid in ids for ids in window]
        # A decode stream may only be absent once it has finished (then for the rest of the window).
        misses = [j for j, present in enumerate(running) if not present]
        assert not misses or misses == list(range(misses[0], len(window))), f"{rid} skipped a step mid-prefill"
    assert stats.blocks_used == 0


def test_cancelling_a_long_prefill_frees_its_blocks_and_service_goes_on(worker):
    rng = random.Random(5)
    prompt = [rng.randrange(4, 700) for _ in range(LONG)]
    flags = ["--max-num-batched-tokens", "1024", "--max-model-len", "32768"]
    with scheduler_of(MODEL, [worker], *flags) as (_, client):
        stream = client.stream(prompt_token_ids=prompt, max_tokens=2, timeout=120)
        first = next(stream)  # a progress message: the prefill is under way
        assert first.prefill_progress.total_tokens == LONG and first.prefill_progress.processed_tokens < LONG
        stream.cancel()
        stats = wait_idle(client)
        assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
        after = client.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert after.completion_tokens == 4
