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
from tests.helpers.worker_steps import chunked_greedy
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

PROMPT_LEN = 100
CHUNKS = (1, 7, 16, 100)
DECODE_STEPS = 3


def run_sequence(worker: Worker, prompt: list[int], chunk: int, table: list[int], seq_id: int):
    return chunked_greedy(worker, prompt, chunk, table, seq_id, DECODE_STEPS)


@pytest.mark.parametrize("family", TINY_FAMILIES + DENSE_FAMILIES + MOE_FAMILIES)
def test_chunked_equals_one_shot_prefill(family):
    model_dir = tiny_checkpoint(family)
    worker = Worker(WorkerConfig(model=str(model_dir), dtype="float32", num_blocks=64, num_threads=2))
    prompt = [random.Random(1).randrange(4, worker.info.vocab_size) for _ in range(PROMPT_LEN)]
    blocks = random.Random(2).sample(range(64), 64)
    full_logits, full_tokens = run_sequence(worker, prompt, PROMPT_LEN, blocks[:8], seq_id=1)
    # eager: transformers' SDPA path would skip Gemma 2's attention soft-cap
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert full_tokens == hf_greedy(hf, prompt, DECODE_STEPS, ignore_eos=True)
    for i, chunk in enumerate(CHUNKS[:-1]):
        table = blocks[8 * (i + 1) : 8 * (i + 2)]
        logits, tokens = run_sequence(worker, prompt, chunk, table, seq_id=2 + i)
        assert tokens == full_tokens, f"chunk {chunk}"
        for ours, ref in zip(logits, full_logits):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
