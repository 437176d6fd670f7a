"""Speculative decoding end to end (issue 30): n-gram drafts on vs off, side by
side on one scheduler + worker, on text that copies its prompt and on free text.

    python -m bench.spec_decode [--streams 1 2 4 8 32] [--max-tokens 64] [--repeats 2] [--dtype bfloat16]
    python -m bench.spec_decode --quick      # smoke test (~1 min)
    python -m bench.spec_decode --streams 2 4 --disable-by-batch-size 4
                                             # drafting up to 4 rows: bench/results/spec_decode_batch4.md

One stack from this tree: a worker (SmolLM2-135M-Instruct, --num-threads 1: the
scheduler has the other core) and a scheduler with --speculative-method ngram (JSON
debug logs: one "step" line per step, with its drafts and accepted drafts).
"Off" is the same requests with GenerateRequest.no_speculation, so both run on
the same processes, pool and machine state; per repetition, for each workload
and stream count, off and on alternate, the first changing each time.

Workloads (chat prompts, greedy, ignore_eos, max_tokens each):
* copy: "Please repeat the following paragraph back to me exactly" + a passage of
  60-90 words (CPython's Language Reference, bench/harness/load.py): the answer
  mostly copies the prompt (SmolLM2-135M sometimes answers something else: the
  acceptance column says how much copying there was);
* free: "Write a short story about" + a few random words: nothing to copy.

Figures, per workload, stream count and variant: output tok/s (completion tokens
/ wall time of the run), steps per generated token (the scheduler's step lines /
tokens: 1.0 for one stream without drafts, less when drafts are accepted), the
worker's CPU ms per generated token (its process CPU time: steadier than wall
time on a shared machine), drafts per step and the acceptance rate (accepted /
drafted tokens), and the ratio on / off of tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

from bench.harness.load import drive, text_words
from bench.harness.machine import announce, cpu_seconds, load_average
from bench.harness.results import fmt, markdown_table, mean, pyplot, save_plot, spread, write_result
from bench.harness.services import DEFAULT_MODEL, REPO, Stack, require_model

NAME = "spec_decode"
WORKLOADS = ("copy", "free")
VARIANTS = {"off": {"no_speculation": True}, "on": {}}
SINGLE_STREAM_ROUNDS = 3
SPEC_FLAGS = ["--speculative-method", "ngram", "--num-speculative-tokens", "4", "--ngram-min", "2", "--ngram-max", "4"]


def prompts(model: Path, workload: str, n: int, seed: int) -> list[list[int]]:
    """n chat prompts of the workload, as token ids (the model's chat template)."""
    from transformers import AutoTokenizer  # the chat template

    tokenizer = AutoTokenizer.from_pretrained(model)
    words, rng = text_words(), random.Random(seed)
    out = []
    for _ in range(n):
        if workload == "copy":
            length = rng.randint(60, 90)
            start = rng.randrange(len(words) - length)
            passage = " ".join(words[start : start + length])
            ask = f"Please repeat the following paragraph back to me exactly.\n\nParagraph: {passage}"
        else:
            ask = "Write a short story about " + ", ".join(rng.sample(words, 3)) + "."
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
        )
        out.append(tokenizer(chat)["input_ids"])
    return out


def run_once(stack: Stack, rounds: list[list[list[int]]], max_tokens: int, fields: dict[str, Any]) -> dict[str, Any]:
    """`rounds`: sets of prompts run one set after the other, each set's streams all at once."""
    seen = len(stack.step_lines())
    assert stack.worker is not None and stack.worker.proc is not None
    load, cpu_before = load_average(), cpu_seconds(stack.worker.proc.pid)
    outs = [
        asyncio.run(drive(stack.scheduler_address, ids, max_tokens, {"ignore_eos": True, **fields})) for ids in rounds
    ]
    time.sleep(0.05)  # the last step's line is written before its tokens go out
    steps = stack.step_lines()[seen:]
    tokens = sum(out.tokens for out in outs)
    return {
        "tok_s": tokens / sum(out.wall_s for out in outs),
        "tokens": tokens,
        "steps": len(steps),
        "drafts": sum(s.get("drafts", 0) for s in steps),
        "accepted": sum(s.get("accepted", 0) for s in steps),
        "worker_cpu_ms": 1e3 * (cpu_seconds(stack.worker.proc.pid) - cpu_before),
        "load": load,
    }


def measure(model: Path, args: argparse.Namespace) -> dict[tuple[str, int, str], list[dict[str, Any]]]:
    """(workload, streams, variant) -> its runs."""
    worker = ["--model", str(model), "--dtype", args.dtype, "--num-blocks", "2048", "--num-threads", "1"]
    scheduler = ["--model", str(model), "--no-prefix-caching", "--admin-port", "-1", *SPEC_FLAGS]
    if args.disable_by_batch_size is not None:
        scheduler += ["--speculative-disable-by-batch-size", str(args.disable_by_batch_size)]
    stack = Stack("spec", REPO, worker, scheduler).start()
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    try:
        for variant in VARIANTS.values():  # warm-up: kernels, channels, both step shapes
            run_once(stack, [prompts(model, "copy", 2, 99)], 16, variant)
        for j in range(args.repeats):
            for w, workload in enumerate(WORKLOADS):
                for n in args.streams:
                    # One stream's run is short and depends on its one prompt: it runs several, in turn.
                    count = SINGLE_STREAM_ROUNDS if n == 1 else 1
                    ids = prompts(model, workload, n * count, seed=1000 * j + n)
                    rounds = [ids[k * n : (k + 1) * n] for k in range(count)]
                    order = list(VARIANTS) if (j + w) % 2 == 0 else list(reversed(VARIANTS))
                    for variant in order:
                        r = run_once(stack, rounds, args.max_tokens, VARIANTS[variant])
                        runs.setdefault((workload, n, variant), []).append(r)
                        print(
                            f"{workload:5} N={n:3} {variant:3}: {r['tok_s']:7.1f} tok/s, "
                            f"{r['steps'] / r['tokens']:.2f} steps/token, accepted {r['accepted']}/{r['drafts']}, "
                            f"load {r['load']:.1f}",
                            flush=True,
                        )
    finally:
        stack.stop()
    return runs


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in runs)
    drafts = sum(r["drafts"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    return {
        "tok_s": [r["tok_s"] for r in runs],
        "steps_per_token": steps / tokens,
        "cpu_ms_per_token": sum(r["worker_cpu_ms"] for r in runs) / tokens,
        "drafts_per_step": drafts / steps,
        "acceptance": sum(r["accepted"] for r in runs) / drafts if drafts else None,
        "load": mean(r["load"] for r in runs),
    }


def report(results: dict[tuple[str, int, str], dict[str, Any]], args: argparse.Namespace, wall_s: float) -> str:
    rows = []
    for workload in WORKLOADS:
        for n in args.streams:
            off, on = results[workload, n, "off"], results[workload, n, "on"]
            ratio = mean(on["tok_s"]) / mean(off["tok_s"])
            cpu_ratio = off["cpu_ms_per_token"] / on["cpu_ms_per_token"]
            acceptance = "" if on["acceptance"] is None else f"{100 * on['acceptance']:.0f}%"
            rows.append(
                [workload, n, spread(off["tok_s"], ".1f"), spread(on["tok_s"], ".1f"), f"**{ratio:.2f}x**",
                 fmt(off["steps_per_token"], 2), fmt(on["steps_per_token"], 2), fmt(off["cpu_ms_per_token"], 1),
                 fmt(on["cpu_ms_per_token"], 1), f"{cpu_ratio:.2f}x", fmt(on["drafts_per_step"], 2), acceptance,
                 fmt(on["load"], 1)]
            )  # fmt: skip
    table = markdown_table(
        ["workload", "streams", "off tok/s", "on tok/s", "on/off", "steps/token off", "steps/token on",
         "worker CPU ms/token off", "on", "CPU off/on", "drafts/step on", "accepted", "load avg"],
        rows,
    )  # fmt: skip
    n = args.disable_by_batch_size
    batch_flag, batch_rule = (
        ("", "") if n is None else (f" --disable-by-batch-size {n}", f" --speculative-disable-by-batch-size {n}")
    )
    notes = (
        f"Command: `python -m bench.spec_decode --streams {' '.join(map(str, args.streams))} --max-tokens "
        f"{args.max_tokens} --repeats {args.repeats} --dtype {args.dtype}{batch_flag}` ({wall_s / 60:.1f} min). "
        f"Model SmolLM2-135M-Instruct, worker --dtype {args.dtype} --num-threads 1, scheduler "
        f"{' '.join(SPEC_FLAGS)}{batch_rule} --no-prefix-caching; off = the same requests with no_speculation. tok/s: mean "
        "(min-max) of the repetitions; steps/token, CPU ms/token, drafts/step and accepted: over all repetitions. "
        "Greedy, ignore_eos, max_tokens each. Targets (issue 30, CPU): >= 1.8x tok/s at 1 stream on the copy "
        "workload, >= 0.97x on free text."
    )
    return table + "\n\n" + notes


def plot(results: dict[tuple[str, int, str], dict[str, Any]], args: argparse.Namespace, name: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{w}\n{n} stream{'s' if n > 1 else ''}" for w in WORKLOADS for n in args.streams]
    keys = [(w, n) for w in WORKLOADS for n in args.streams]
    width = 0.38
    for k, variant in enumerate(VARIANTS):
        xs = [i + k * width for i in range(len(keys))]
        axes[0].bar(xs, [mean(results[w, n, variant]["tok_s"]) for w, n in keys], width, label=f"speculation {variant}")
        axes[1].bar(xs, [results[w, n, variant]["steps_per_token"] for w, n in keys], width, label=variant)
    for ax, ylabel in zip(axes, ("output tok/s", "engine steps per generated token"), strict=True):
        ax.set_xticks([i + width / 2 for i in range(len(keys))], labels)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("Speculative decoding (n-gram drafts), SmolLM2-135M on CPU")
    save_plot(fig, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="smoke test: 1 and 4 streams, 24 tokens, once")
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        help="the scheduler's --speculative-disable-by-batch-size (default: its own); "
        "the report goes to bench/results/spec_decode_batch<N>.md",
    )
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens, args.repeats = [1, 4], 24, 1
    announce(NAME)
    started = time.perf_counter()
    model = require_model(DEFAULT_MODEL)
    runs = measure(model, args)
    results = {key: summary(rs) for key, rs in runs.items()}
    body = report(results, args, time.perf_counter() - started)
    print(body)
    name = NAME if args.disable_by_batch_size is None else f"{NAME}_batch{args.disable_by_batch_size}"
    write_result(name, "Speculative decoding: n-gram drafts on vs off, copy-heavy and free text", body)
    plot(results, args, name)


if __name__ == "__main__":
    main()
