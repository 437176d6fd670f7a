"""Output tokens/s: N concurrent greedy streams through the real system (worker +
scheduler processes, gRPC) beside transformers `generate` with batch N on the
same prompts, in the same run.

    python -m bench.throughput --streams 16 --max-tokens 64 --repeats 3
"""
from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.common import markdown_table, median, write_result
from scheduler_svc.client import SchedulerClient
from svc_common.processes import REPO, Cluster

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "Explain photosynthesis in one paragraph.",
    "List three uses of a paperclip:", "What is 17 times 23?", "Describe a cat to someone who has never seen one.",
    "The best way to learn programming is", "Once upon a time in a small village,",
    "Give me a recipe for pancakes.", "Why is the sky blue?", "Translate 'good morning' into Spanish:",
    "The three laws of motion are", "Summarize the plot of Romeo and Juliet.", "A haiku about autumn:",
    "How do airplanes stay in the air?", "The meaning of life is",
]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]


def run_system(target: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    with SchedulerClient(target) as client:
        def one(prompt):
            return client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600)

        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        elapsed = time.perf_counter() - start
    return elapsed, sum(r.completion_tokens for r in results)


def run_transformers(model, tokenizer, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - batch.input_ids.shape[1]) * len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    prompts = prompts_for(args.streams)
    torch_dtype = getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch_dtype).eval()
    rows, rates = [], {"pagedserve": [], "transformers": []}
    with Cluster(Path(args.model), ["--dtype", args.dtype, "--num-blocks", "1024"]) as cluster:
        run_system(cluster.address, prompts[:2], 4)  # warm-up
        run_transformers(model, tokenizer, prompts[:2], 4)
        for _ in range(args.repeats):
            # Alternate the two so drift on this noisy machine hits both alike.
            for name, fn in (("pagedserve", lambda: run_system(cluster.address, prompts, args.max_tokens)),
                             ("transformers", lambda: run_transformers(model, tokenizer, prompts, args.max_tokens))):
                elapsed, tokens = fn()
                rates[name].append(tokens / elapsed)
    ours, theirs = median(rates["pagedserve"]), median(rates["transformers"])
    rows = [["pagedserve (worker + scheduler, gRPC)", args.streams, args.max_tokens, f"{ours:.1f}",
             " ".join(f"{r:.0f}" for r in rates["pagedserve"])],
            [f"transformers generate, batch {args.streams}", args.streams, args.max_tokens, f"{theirs:.1f}",
             " ".join(f"{r:.0f}" for r in rates["transformers"])]]
    table = markdown_table(["system", "streams", "tokens each", "median output tok/s", "runs"], rows)
    notes = f"ratio pagedserve / transformers: **{ours / theirs:.2f}x** (medians of {args.repeats}, dtype {args.dtype})"
    print(table, "\n\n" + notes)
    print(f"wrote {write_result('throughput', 'Throughput: concurrent greedy streams', table, notes)}")


if __name__ == "__main__":
    main()
