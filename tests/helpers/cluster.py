"""Checking a running scheduler + worker cluster: transformers' model and its greedy
output as the reference, and the scheduler's stats once it has gone idle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from scheduler_svc.client import SchedulerClient
from tools.processes import Cluster, ServiceProcess

# A scheduler drafting with every row that runs (the batch rule would stop at 2 by
# default), n-grams short enough for the tiny random models' repetitive text.
SPEC_FLAGS = [
    "--speculative-method",
    "ngram",
    "--num-speculative-tokens",
    "4",
    "--ngram-min",
    "1",
    "--ngram-max",
    "3",
    "--speculative-disable-by-batch-size",
    "8",
]


def load_model(model_dir: Path):
    """transformers' float32 model of the checkpoint, in eval mode: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' greedy continuation; ignore_eos: it runs on past EOS, as a request with ignore_eos does."""
    import copy

    import torch

    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens, config.do_sample = max_tokens, False
    if ignore_eos:
        config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


def wait_idle(client: SchedulerClient, timeout_s: float = 10.0):
    """Stats after the last stream: the engine frees blocks on its own loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_pool_clean(client: SchedulerClient, cluster: Cluster | ServiceProcess) -> None:
    """Idle with every block back (the pool's counters), and the engine's own audit of
    its pool, which runs once it is idle (health interval 1 s), found nothing.
    `cluster`: a Cluster, or the scheduler process itself."""
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
    assert stats.blocks_allocated_total == stats.blocks_freed_total
    time.sleep(1.5)
    scheduler = cluster.scheduler if isinstance(cluster, Cluster) else cluster
    assert scheduler is not None
    assert "engine audit failed" not in scheduler.log_path.read_text(errors="replace")


@contextlib.contextmanager
def scheduler_of(
    model_dir: Path, workers: list[ServiceProcess], *args: str
) -> Iterator[tuple[ServiceProcess, SchedulerClient]]:
    """A scheduler of a test's own in front of workers its module started once (a
    worker's start is most of a short test's time). A new scheduler knows none of the
    workers' blocks, so nothing one test cached reaches the next. On the way out its
    log must show no internal error."""
    addresses = ",".join(w.address for w in workers)
    with ServiceProcess("scheduler_svc", ["--model", str(model_dir), "--workers", addresses, *args]) as proc:
        with SchedulerClient(proc.address) as client:
            yield proc, client
        log = proc.log_path.read_text(errors="replace")
        for sign in ("Traceback", "engine core failed", "engine audit failed"):
            assert sign not in log, log[-4000:]
