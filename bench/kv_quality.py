"""KV cache precision: quality and memory of fp32 / fp16 / bf16 / fp8 / int8 caches on
the default model, all with fp32 weights, against the fp32 cache as the baseline.

    python -m bench.kv_quality [--text-tokens 3072] [--gen-tokens 128]

In process (worker_svc.worker.Worker, the torch backend on CPU): one model, one
paged cache per KV dtype, the same steps through each.

* Teacher-forced over a fixed text (the Python Language Reference sections that
  ship with CPython as pydoc_data.topics), prefilled in 512-token chunks through
  the paged cache, so every chunk attends over the quantized K/V of the earlier
  ones (and its own): perplexity, max / mean |logit - baseline logit| over all
  positions and the whole vocabulary, and top-1 agreement with the baseline.
* Free-running greedy: --gen-tokens tokens for each of a few chat prompts (EOS
  ignored), positional agreement with the baseline's tokens and the common prefix.
* Memory: bytes per token (K + V, all layers, scales included) and how many
  16-token blocks fit in 512 MB (as --kv-cache-memory-mb 512 sizes the pool).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from transformers import AutoTokenizer

from bench.harness.machine import announce
from bench.harness.results import markdown_table, write_result
from bench.harness.services import REPO
from worker_svc.attention.kv_cache import PagedKVCache
from worker_svc.config import WorkerConfig
from worker_svc.runner.batch import plan_batch
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.upload import upload_batch
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.builder import StepBuilder
from worker_svc.worker import Worker, resolve_kv_dtype

KV_DTYPES = ["fp32", "fp16", "bf16", "fp8", "int8"]  # the first is the baseline
TEXT_TOPICS = ["execmodel", "exceptions", "try", "with", "import", "function", "class"]
PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a paged KV cache works in an LLM inference server.",
    "What are the main causes of the seasons on Earth?",
    "Give me a recipe for a simple tomato soup, step by step.",
]
POOL_MB = 512
CHUNK = 512


def fixed_text_tokens(tokenizer, n: int) -> list[int]:
    from pydoc_data.topics import topics

    ids = tokenizer("\n\n".join(topics[t] for t in TEXT_TOPICS)).input_ids
    if len(ids) < n:
        raise SystemExit(f"the fixed text has {len(ids)} tokens, fewer than --text-tokens {n}")
    return ids[:n]


class Variant:
    """One KV dtype: its own paged cache and runner over the shared model."""

    def __init__(self, name: str, worker: Worker, num_blocks: int):
        spec = worker.model.spec
        self.name = name
        self.dtype = resolve_kv_dtype(name, torch.float32, worker.device)
        self.model = worker.model
        self.cache = PagedKVCache(
            spec.num_layers,
            num_blocks,
            spec.num_kv_heads,
            16,
            spec.head_dim,
            self.dtype,
            worker.device,
            worker.cache.ops,
        )
        self.runner = ModelRunner(worker.model, self.cache, Sampler(0))

    @torch.inference_mode()
    def chunk_logits(self, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
        """fp32 logits [len(tokens), vocab] of a prefill chunk at positions start..."""
        step = StepBuilder(block_size=16).add(1, tokens, start, table).build(0)
        return self.model.logits(self.runner.forward(upload_batch(plan_batch(step), self.runner.uploader)))

    def greedy(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]  # 256 positions each
        out: list[list[int]] = [[] for _ in prompts]
        pending = [list(p) for p in prompts]
        starts = [0] * len(prompts)
        for step in range(max_tokens):
            builder = StepBuilder(block_size=16)
            for i, tokens in enumerate(pending):
                builder.add(i, tokens, starts[i], tables[i], sample=True)
            samples = self.runner.execute(builder.build(step)).samples
            sampled = dict(zip(samples.seq_ids.tolist(), samples.token_ids.tolist()))
            for i in range(len(prompts)):
                starts[i] += len(pending[i])
                out[i].append(sampled[i])
                pending[i] = [sampled[i]]
        return out


def teacher_forced(variants: list[Variant], tokens: list[int]) -> dict[str, dict[str, float]]:
    """Lockstep over the chunks: every variant sees the same chunk, errors are taken
    against the baseline's logits of that chunk."""
    table = list(range(-(-len(tokens) // 16)))
    acc = {v.name: dict(nll=0.0, max_err=0.0, sum_err=0.0, top1=0, n=0) for v in variants}
    for start in range(0, len(tokens) - 1, CHUNK):
        chunk = tokens[start : start + CHUNK]
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(chunk)])
        base = None
        for v in variants:
            logits = v.chunk_logits(chunk, start, table)[: len(targets)]
            a = acc[v.name]
            a["nll"] += float(-torch.log_softmax(logits, -1).gather(1, targets[:, None]).sum())
            a["n"] += len(targets)
            if base is None:
                base = logits
                a["top1"] += len(targets)
                continue
            err = (logits - base).abs()
            a["max_err"] = max(a["max_err"], float(err.max()))
            a["sum_err"] += float(err.sum(dtype=torch.float64))
            a["top1"] += int((logits.argmax(-1) == base.argmax(-1)).sum())
    vocab = variants[0].model.spec.vocab_size
    return {
        name: dict(
            ppl=math.exp(a["nll"] / a["n"]),
            max_err=a["max_err"],
            mean_err=a["sum_err"] / (a["n"] * vocab),
            top1=a["top1"] / a["n"],
        )
        for name, a in acc.items()
    }


def agreement(got: list[list[int]], want: list[list[int]]) -> tuple[float, float]:
    """(positional agreement over all tokens, mean common-prefix length)."""
    same = total = 0
    prefixes = []
    for g, w in zip(got, want):
        flags = [a == b for a, b in zip(g, w)]
        same += sum(flags)
        total += len(w)
        prefixes.append(next((i for i, f in enumerate(flags) if not f), len(flags)))
    return same / total, sum(prefixes) / len(prefixes)


def main() -> None:
    announce("kv_quality")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--text-tokens", type=int, default=3072)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    text = fixed_text_tokens(tokenizer, args.text_tokens)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in PROMPTS
    ]
    assert all(len(p) + args.gen_tokens <= 256 for p in prompts), "greedy tables hold 256 positions per prompt"
    num_blocks = max(-(-args.text_tokens // 16), 16 * len(PROMPTS))
    worker = Worker(
        WorkerConfig(model=args.model, dtype="float32", kv_dtype="fp32", num_blocks=1, num_threads=args.num_threads)
    )
    spec = worker.model.spec
    variants = [Variant(name, worker, num_blocks) for name in KV_DTYPES]

    quality = teacher_forced(variants, text)
    generated = {v.name: v.greedy(prompts, args.gen_tokens) for v in variants}

    fp16_block = PagedKVCache.bytes_per_block(spec.num_layers, spec.num_kv_heads, 16, spec.head_dim, torch.float16)
    base_ppl = quality[KV_DTYPES[0]]["ppl"]
    fp16_ppl = quality["fp16"]["ppl"]
    rows = []
    for v in variants:
        q = quality[v.name]
        block = v.cache.block_bytes
        agree, prefix = agreement(generated[v.name], generated[KV_DTYPES[0]])
        rows.append(
            [
                f"{v.name} ({str(v.dtype).removeprefix('torch.')})",
                block // 16,
                v.cache.scale_block_bytes // 16,
                f"{block / fp16_block:.1%}",
                POOL_MB * 2**20 // block,
                f"{q['ppl']:.4f}",
                f"{(q['ppl'] / base_ppl - 1):+.3%}",
                f"{(q['ppl'] / fp16_ppl - 1):+.3%}",
                f"{q['max_err']:.3f}",
                f"{q['mean_err']:.4f}",
                f"{q['top1']:.2%}",
                f"{agree:.1%}",
                f"{prefix:.1f}",
            ]
        )
    headers = [
        "kv dtype",
        "bytes/token",
        "of which scales",
        "vs fp16",
        f"blocks in {POOL_MB} MB",
        "perplexity",
        "Δppl vs fp32",
        "Δppl vs fp16",
        "max |Δlogit|",
        "mean |Δlogit|",
        "top-1 agree (text)",
        f"greedy agree ({len(PROMPTS)}x{args.gen_tokens})",
        "common prefix",
    ]
    table = markdown_table(headers, rows)
    notes = (
        f"Model {spec.model_type} `{worker.info.model_name}` ({spec.num_layers} layers, {spec.num_kv_heads} KV "
        f"heads, head_dim {spec.head_dim}), fp32 weights and activations for every row, torch backend on "
        f"{worker.info.device}. Baseline: the fp32 KV cache (first row); logit errors and agreements are "
        f"against it. Text: {len(text)} tokens of CPython's pydoc_data.topics "
        f"({', '.join(TEXT_TOPICS)}), teacher-forced in {CHUNK}-token chunks through the paged cache. Greedy: "
        f"{len(PROMPTS)} chat prompts, {args.gen_tokens} tokens each, EOS ignored. bytes/token: K + V over all "
        f"layers, per-token-per-head scales (fp32; int8 adds an int8 zero point) included. "
        f"Run time {time.perf_counter() - started:.0f} s."
    )
    print(table, "\n\n" + notes)
    print(f"wrote {write_result('kv_quality', 'KV cache precision: quality and memory', table, notes)}")


if __name__ == "__main__":
    main()
