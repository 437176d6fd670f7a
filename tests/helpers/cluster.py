"""Checking a running scheduler + worker cluster: transformers' greedy output as
the reference, and the scheduler's stats once it has gone idle."""

from __future__ import annotations

import time

from scheduler_svc.client import SchedulerClient


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def wait_idle(client: SchedulerClient, timeout_s: float = 10.0):
    """Stats after the last stream: the engine frees blocks on its own loop."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
