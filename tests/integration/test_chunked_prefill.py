"""Chunked prefill computes what one-shot prefill computes: causal masking and
the sliding windows (Gemma 2/3, Mistral) hold across chunk boundaries, for every tiny family
(one-token chunks for a few that cover its paths; the rest are slow);
and the one-shot tokens are transformers' (fp32): the one in-process exactness check of every
family that `make test` runs (the real-service sweeps keep a few families; the rest are slow)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import DENSE_FAMILIES, MOE_FAMILIES, TINY_FAMILIES, tiny_checkpoint
from tests.helpers.cluster import hf_greedy
from tests.helpers.sweeps import sweep
from tests.helpers.worker_steps import chunked_greedy
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

PROMPT_LEN = 100
CHUNKS = (7, 16)  # uneven chunks across block edges and every sliding window
DECODE_STEPS = 3
ALL_FAMILIES = TINY_FAMILIES + DENSE_FAMILIES + MOE_FAMILIES
# One-token chunks (a hundred steps, ~10 s of CPU a family, most of this file's time)
# walk a single token across every window edge: make test keeps the sliding-window
# kinds, interleaved with full layers (gemma3), soft-capped (gemma2) and on every
# layer (mistral). Elsewhere a one-token step is the decode step every family's
# test above ends with (make test-slow runs all families).
ONE_TOKEN_FAMILIES = sweep(ALL_FAMILIES, keep=("gemma3", "gemma2", "mistral"))


class FamilyRun:
    """A worker on `family`'s tiny checkpoint, the prompt, and the one-shot prefill's
    logits and tokens; each chunking runs on its own blocks of the same pool."""

    def __init__(self, family: str):
        self.model_dir = tiny_checkpoint(family)
        self.worker = Worker(WorkerConfig(model=str(self.model_dir), dtype="float32", num_blocks=64, num_threads=2))
        self.prompt = [random.Random(1).randrange(4, self.worker.info.vocab_size) for _ in range(PROMPT_LEN)]
        self.blocks = random.Random(2).sample(range(64), 64)
        self.full_logits, self.full_tokens = self.run(PROMPT_LEN, 0)

    def run(self, chunk: int, index: int) -> tuple[list[torch.Tensor | None], list[int]]:
        table = self.blocks[8 * index : 8 * (index + 1)]
        return chunked_greedy(self.worker, self.prompt, chunk, table, index + 1, DECODE_STEPS)

    def assert_chunked_equal(self, chunk: int, index: int) -> None:
        logits, tokens = self.run(chunk, index)
        assert tokens == self.full_tokens, f"chunk {chunk}"
        for ours, ref in zip(logits, self.full_logits):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_chunked_equals_one_shot_prefill(family):
    run = FamilyRun(family)
    # eager: transformers' SDPA path would skip Gemma 2's attention soft-cap
    hf = AutoModelForCausalLM.from_pretrained(run.model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert run.full_tokens == hf_greedy(hf, run.prompt, DECODE_STEPS, ignore_eos=True)
    for i, chunk in enumerate(CHUNKS):
        run.assert_chunked_equal(chunk, i + 1)


@pytest.mark.parametrize("family", ONE_TOKEN_FAMILIES)
def test_one_token_chunks_equal_one_shot_prefill(family):
    FamilyRun(family).assert_chunked_equal(1, 1)
