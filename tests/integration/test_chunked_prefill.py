"""Chunked prefill computes what one-shot prefill computes: causal masking and
the sliding windows (Gemma 2/3, Mistral) hold across chunk boundaries, for every tiny family;
and the one-shot tokens are transformers' (fp32): the one in-process exactness check of every
family that `make test` runs (the real-service sweeps keep a few families; the rest are slow)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import DENSE_FAMILIES, MOE_FAMILIES, TINY_FAMILIES, tiny_checkpoint
from tests.helpers.cluster import hf_greedy
from tests.helpers.worker_steps import Seq, sampled, step_input
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

PROMPT_LEN = 100
CHUNKS = (1, 7, 16, 100)
DECODE_STEPS = 3


def slots(table: list[int], start: int, end: int) -> list[int]:
    return [table[p // 16] * 16 + p % 16 for p in range(start, end)]


def run_sequence(worker: Worker, prompt: list[int], chunk: int, table: list[int], seq_id: int):
    """Prefill in `chunk`-token steps, then greedy decodes: (logits, tokens)."""
    logits, tokens, pos, step_id = [], [], 0, seq_id * 1000
    while pos < len(prompt):
        end = min(pos + chunk, len(prompt))
        sample = end == len(prompt)
        out = worker.step(
            step_input(
                step_id,
                [],
                [Seq(seq_id, prompt[pos:end], pos, table, slots(table, pos, end), sample, return_logits=sample)],
            )
        )
        step_id, pos = step_id + 1, end
    for _ in range(DECODE_STEPS):
        token = sampled(out)[0]
        logits.append(token.logits)
        tokens.append(token.token_id)
        out = worker.step(
            step_input(
                step_id,
                [],
                [Seq(seq_id, [token.token_id], pos, table, slots(table, pos, pos + 1), True, return_logits=True)],
            )
        )
        step_id, pos = step_id + 1, pos + 1
    return logits, tokens


@pytest.mark.parametrize("family", TINY_FAMILIES + DENSE_FAMILIES + MOE_FAMILIES)
def test_chunked_equals_one_shot_prefill(family):
    model_dir = tiny_checkpoint(family)
    worker = Worker(WorkerConfig(model=str(model_dir), dtype="float32", num_blocks=64, num_threads=2))
    prompt = [random.Random(1).randrange(4, worker.info.vocab_size) for _ in range(PROMPT_LEN)]
    blocks = random.Random(2).sample(range(64), 64)
    full_logits, full_tokens = run_sequence(worker, prompt, PROMPT_LEN, blocks[:8], seq_id=1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert full_tokens == hf_greedy(ref, prompt, DECODE_STEPS, ignore_eos=True)
    for i, chunk in enumerate(CHUNKS[:-1]):
        table = blocks[8 * (i + 1) : 8 * (i + 2)]
        logits, tokens = run_sequence(worker, prompt, chunk, table, seq_id=2 + i)
        assert tokens == full_tokens, f"chunk {chunk}"
        for ours, ref in zip(logits, full_logits):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
