"""The newer families' own kernels on the machine's device, token-exact with
transformers (fp32): Qwen2 (q/k/v biases), Gemma 2 (soft-capped attention scores,
alternating sliding windows) and Qwen2-MoE (routed and shared experts). On a CPU
machine the worker runs its C++ kernels; under `make gpu-check` (bench/gpu_check.py
lists this file) the same test runs the Triton attention with its soft-cap and the
Triton MoE grouped GEMM, compiled."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy
from tests.helpers.worker_steps import chunked_greedy
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LEN, CHUNK, DECODES = 45, 16, 12  # chunks over cached context; past Gemma 2's window of 8


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "qwen2_moe"])
def test_greedy_tokens_equal_transformers_on_this_device(family):
    model_dir = tiny_checkpoint(family)
    worker = Worker(WorkerConfig(model=str(model_dir), dtype="float32", device=DEVICE, num_blocks=16))
    # Eager attention: transformers' SDPA path would drop Gemma 2's score soft-cap.
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    rng = random.Random(family)
    for seq_id in (1, 2):
        prompt = [rng.randrange(4, 700) for _ in range(PROMPT_LEN)]
        table = rng.sample(range(16), 4)
        _, tokens = chunked_greedy(worker, prompt, CHUNK, table, seq_id, DECODES)
        assert tokens == hf_greedy(ref, prompt, DECODES, ignore_eos=True), f"{family} on {DEVICE}"
