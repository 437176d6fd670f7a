"""Greedy tokens of a tiny GGUF model: a worker's, one step per token, and
transformers' on the same file (it dequantizes with the gguf package), the
oracle of the GGUF exactness tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.worker import Worker

PROMPT = [5, 17, 99, 3, 250, 42, 8, 77, 130, 19, 61]
# 60 rows of x in the prefill: the kernels' packed tiles (quant_linear_cpu.cpp: from 16 rows)
LONG_PROMPT = [(7 * i + 3) % 240 + 2 for i in range(60)]
NEW_TOKENS = 8
BLOCK_SIZE = 16
TABLE = [3, 0, 5, 1, 6, 2, 4]  # blocks out of order; a test's worker needs 7


def worker_tokens(worker: Worker, prompt: list[int] = PROMPT) -> list[int]:
    """Greedy: one prefill step, then one decode step per token."""
    table = TABLE[: -(-(len(prompt) + NEW_TOKENS) // BLOCK_SIZE)]

    def seq(tokens: list[int], start: int) -> Seq:
        slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, start + len(tokens))]
        return Seq(0, tokens, start, table, slots, sample=True)

    out: list[int] = []
    tokens, start = prompt, 0
    for step_id in range(1, NEW_TOKENS + 1):
        [token] = sampled(worker.step(step_input(step_id, [], [seq(tokens, start)])))
        out.append(token.token_id)
        start += len(tokens)
        tokens = [token.token_id]
    return out


def reference_tokens(path: Path, prompt: list[int] = PROMPT) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return ids[0, len(prompt) :].tolist()
