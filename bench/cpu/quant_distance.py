"""How far --quant-activations int8 moves the tokens (issue 38): greedy generations of
the shipped Q4_1 GGUF with int8 activations against the same file with fp32
activations (--quant-activations none, --dtype float32: the path that is token-exact
with transformers on the dequantized weights), in process, one paged fp32 cache each.

    python -m bench.cpu.quant_distance [--gen-tokens 64]

Prints, per prompt, the position of the first differing token (or "=" where all are
equal), and overall the fraction of positions identical and the mean common prefix.
"""

from __future__ import annotations

import argparse
import json
import sys

from transformers import AutoTokenizer

from bench.cpu.worker_step import MODEL_DIR, SHIPPED_GGUF
from bench.kv_quality import Variant, agreement
from svc_common.cpu_features import read_cpu_features
from worker_svc.config import WorkerConfig
from worker_svc.worker import Worker

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a paged KV cache works in an LLM inference server.",
    "What are the main causes of the seasons on Earth?",
    "Give me a recipe for a simple tomato soup, step by step.",
    "List five prime numbers greater than 100 and explain why they are prime.",
    "Translate 'the cat sleeps on the warm windowsill' into French and Spanish.",
    "Write a Python function that reverses a linked list.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen-tokens", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    assert all(len(p) + args.gen_tokens <= 256 for p in prompts), "greedy tables hold 256 positions per prompt"
    generated = {}
    for mode in ("none", "int8"):
        config = WorkerConfig(
            model=SHIPPED_GGUF, dtype="float32", quant_activations=mode, num_blocks=1, num_threads=args.num_threads
        )
        generated[mode] = Variant("fp32", Worker(config), 16 * len(prompts)).greedy(prompts, args.gen_tokens)
    first = [
        next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        for got, want in zip(generated["int8"], generated["none"])
    ]
    identical, prefix = agreement(generated["int8"], generated["none"])
    record = dict(
        cpu=read_cpu_features().describe(),
        prompts=len(prompts),
        gen_tokens=args.gen_tokens,
        first_divergence=["=" if f is None else f for f in first],
        identical_positions=round(identical, 4),
        mean_common_prefix=round(prefix, 2),
        all_equal=sum(f is None for f in first),
    )
    print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
