"""Structured outputs end to end: what a JSON-schema constraint costs a real
scheduler + worker, against the same requests unconstrained, and what each way
of overlapping constrained rows with the step in flight gives.

    python -m bench.structured [--models tiny smollm2] [--streams 1 32] [--max-tokens 64] [--repeats 3]
    python -m bench.structured --quick      # smoke test (~1 min)

Per model, two stacks (worker + scheduler, JSON debug logs) from this tree:
* "late masks" (the default): a constrained decode is planned ahead like any
  other; its mask is computed once the token it follows is known and sent in a
  StepMasks call while the worker runs the forward;
* "held back" (--no-constrained-ahead): a constrained decode is not planned
  ahead of its token, so it runs every other step, with its mask in the Step.

Workload: N streams at once, prompts of 40-80 random token ids, greedy, max_tokens
each; unconstrained ones with ignore_eos, constrained ones with a JSON schema
(an order: an array of at least 64 objects with a bounded string, a bounded
integer and an enum) that cannot be complete before max_tokens, so every stream
gives exactly max_tokens tokens. Per repetition, for each N, the four runs go
one after the other (free and constrained on each stack), the first in turn
changing, so the machine's load (other sessions share its 2 cores) falls on
all alike; the load average is printed with each run.

A. Output tok/s (completion tokens / wall time of the run) and the ratio
   constrained / unconstrained of the same stack: the target is >= 0.8x at 32
   streams.
B. Mask time per step: the scheduler's own measure of computing a step's masks
   on the grammar engine's threads (`mask_ms` of its "step" log line: inline and
   late masks), the step period (time between consecutive step lines) and the
   share of the period the masks take; with late masks they overlap the forward.
C. Compile time of real schemas (bench/structured_schemas.py) with the
   scheduler's compiler on each model's vocabulary: cold (fresh compiler: the
   grammar built and its first mask), and cached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.harness.load import drive, random_prompts
from bench.harness.machine import announce, cpu_seconds, load_average
from bench.harness.results import fmt, markdown_table, mean, pyplot, save_plot, spread, write_result
from bench.harness.services import DEFAULT_MODEL, REPO, Stack, require_model, tiny_model
from bench.structured_schemas import REAL_SCHEMAS
from scheduler_svc.structured import Constraint, GrammarCompiler, GrammarVocab
from scheduler_svc.text.tokenizer import load_tokenizer

NAME = "structured"
ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                    "tag": {"enum": ["new", "used", "spare"]},
                },
                "required": ["name", "qty", "tag"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
CONSTRAINED = {"json_schema": json.dumps(ORDER)}
STACKS = {"late masks": [], "held back": ["--no-constrained-ahead"]}
SCHEDULER_FLAGS = ["--no-prefix-caching", "--admin-port", "-1"]
SHORT_RUN_REPEATS = 3  # one stream's run is short and noisy: it repeats more


def models(names: list[str]) -> dict[str, Path]:
    known = {"tiny": lambda: tiny_model("llama"), "smollm2": lambda: require_model(DEFAULT_MODEL)}
    return {name: known[name]() for name in names}


def timestamp(record: dict[str, Any]) -> float:
    return datetime.fromisoformat(record["timestamp"]).timestamp()


def run_once(stack: Stack, n: int, max_tokens: int, vocab: int, constrained: bool) -> dict[str, Any]:
    seen = len(stack.step_lines())
    load = load_average()
    assert stack.scheduler is not None and stack.scheduler.proc is not None
    pid = stack.scheduler.proc.pid
    cpu_before = cpu_seconds(pid)
    prompts = random_prompts(n, n, 4, vocab, (40, 80))
    out = asyncio.run(drive(stack.scheduler_address, prompts, max_tokens, CONSTRAINED if constrained else None))
    time.sleep(0.05)  # the last step's line is written before its tokens go out
    cpu = cpu_seconds(pid) - cpu_before
    steps = stack.step_lines()[seen:]
    times = [timestamp(s) for s in steps]
    decode = [(b - a, s) for a, b, s in zip(times, times[1:], steps[1:], strict=False) if s["tokens"] == s["seqs"]]
    return {
        "tok_s": out.tok_s,
        "load": load,
        "steps": len(steps),
        "period_ms": [1e3 * p for p, _ in decode],
        "mask_ms": [s.get("mask_ms", 0.0) for _, s in decode],
        "forward_ms": [s["forward_ms"] for _, s in decode],
        "late_rows": sum(s.get("late_masks", 0) for s in steps),
        "inline_rows": sum(s.get("masks", 0) for s in steps),
        "seqs": [s["seqs"] for _, s in decode],
        "sched_cpu_ms": 1e3 * cpu / max(len(steps), 1),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """tok/s of each run; per-step figures as means over the decode steps of all; counts summed."""
    per_step = {"period": "period_ms", "mask": "mask_ms", "forward": "forward_ms", "seqs": "seqs"}
    summary: dict[str, Any] = {key: mean(x for r in runs for x in r[field]) for key, field in per_step.items()}
    summary |= {key: mean(r[field] for r in runs) for key, field in (("load", "load"), ("sched_cpu", "sched_cpu_ms"))}
    summary |= {"late": sum(r["late_rows"] for r in runs), "inline": sum(r["inline_rows"] for r in runs)}
    return summary | {"tok_s": [r["tok_s"] for r in runs]}


def measure(model: Path, args: argparse.Namespace) -> dict[str, dict[int, dict[str, Any]]]:
    """variant -> N -> summary; variants: '<stack>: free' and '<stack>: constrained'."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    worker = ["--model", str(model), "--dtype", "float32", "--num-blocks", "2048", "--num-threads", "1"]
    scheduler = ["--model", str(model), *SCHEDULER_FLAGS]
    stacks = []
    try:
        for label, flags in STACKS.items():
            stacks.append(Stack(label, REPO, worker, [*scheduler, *flags]).start())
        variants = [(stack, constrained) for stack in stacks for constrained in (False, True)]
        for stack, constrained in variants:  # warm-up: kernels, channels, the grammar's first lexer states
            run_once(stack, 4, 16, vocab, constrained)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {_label(s, c): {} for s, c in variants}
        for i, n in enumerate(args.streams):
            repeats = args.repeats * (SHORT_RUN_REPEATS if n == 1 else 1)
            for j in range(repeats):
                turn = (i + j) % len(variants)
                for stack, constrained in variants[turn:] + variants[:turn]:
                    r = run_once(stack, n, args.max_tokens, vocab, constrained)
                    runs[_label(stack, constrained)].setdefault(n, []).append(r)
                    print(
                        f"{model.name:24} {_label(stack, constrained):26} N={n:3}: {r['tok_s']:7.0f} tok/s, "
                        f"mask {fmt(mean(r['mask_ms']), 2)} ms/step of {fmt(mean(r['period_ms']), 2)}, "
                        f"load {r['load']:.1f}",
                        flush=True,
                    )
        return {label: {n: summarize(rs) for n, rs in by_n.items()} for label, by_n in runs.items()}
    finally:
        for stack in stacks:
            stack.stop()


def _label(stack: Stack, constrained: bool) -> str:
    return f"{stack.label}: {'constrained' if constrained else 'free'}"


def compile_times(model: Path, rounds: int) -> dict[str, tuple[float, float]]:
    """schema -> (cold compile ms, lowest of `rounds` fresh compilers; cached compile us)."""
    vocab = GrammarVocab.from_model_tokenizer(load_tokenizer(model))
    out = {}
    for name, schema in {**REAL_SCHEMAS, "order (bench)": ORDER}.items():
        constraint = Constraint.json_schema(schema)
        cold = []
        for _ in range(rounds):
            compiler = GrammarCompiler(vocab)
            cold.append(compiler.compile(constraint).compile_s * 1e3)
            started = time.perf_counter()
            compiler.compile(constraint)
            cached = (time.perf_counter() - started) * 1e6
            compiler.close()
        out[name] = (min(cold), cached)
    return out


def report(results: dict[str, Any], compiles: dict[str, Any], args: argparse.Namespace, wall_s: float) -> str:
    sections = []
    rows, mask_rows = [], []
    for model, by_variant in results.items():
        for n in args.streams:
            for stack in STACKS:
                free, constrained = by_variant[f"{stack}: free"][n], by_variant[f"{stack}: constrained"][n]
                ratio = mean(constrained["tok_s"]) / mean(free["tok_s"])
                rows.append(
                    [model, n, stack, spread(free["tok_s"], ".0f"), spread(constrained["tok_s"], ".0f"),
                     f"**{ratio:.2f}x**", fmt(free["load"], 1)]
                )  # fmt: skip
                mask_rows.append(
                    [model, n, stack, fmt(constrained["mask"], 3), fmt(constrained["period"], 2),
                     f"{100 * constrained['mask'] / constrained['period']:.1f}%", fmt(free["period"], 2),
                     fmt(constrained["forward"], 2), fmt(constrained["seqs"], 1), f"{constrained['late']:,}",
                     f"{constrained['inline']:,}", fmt(constrained["sched_cpu"], 2), fmt(free["sched_cpu"], 2)]
                )  # fmt: skip
    sections.append(
        "### A. Output tok/s, constrained vs unconstrained (mean (min-max) of the repetitions)\n\n"
        + markdown_table(
            ["model", "streams", "constrained rows", "free tok/s", "constrained tok/s", "ratio", "load avg"], rows
        )
    )
    sections.append(
        "### B. Masks per decode step and the step period (means over the decode steps of every repetition)\n\n"
        + markdown_table(
            [
                "model",
                "streams",
                "constrained rows",
                "mask ms/step",
                "period ms (constrained)",
                "mask share",
                "period ms (free)",
                "forward ms",
                "seqs/step",
                "late mask rows",
                "inline mask rows",
                "scheduler CPU ms/step (constrained)",
                "(free)",
            ],
            mask_rows,
        )  # fmt: skip
    )
    compile_rows = [
        [schema, *(f"{compiles[m][schema][0]:.2f} ms / {compiles[m][schema][1]:.0f} us" for m in compiles)]
        for schema in next(iter(compiles.values()))
    ]
    sections.append(
        "### C. Compile time of real schemas, cold / cached (the scheduler's compiler, lowest of "
        f"{args.compile_rounds} fresh compilers)\n\n" + markdown_table(["schema", *compiles], compile_rows)
    )
    notes = (
        f"Command: `python -m bench.structured --models {' '.join(args.models)} --streams "
        f"{' '.join(map(str, args.streams))} --max-tokens {args.max_tokens} --repeats {args.repeats}` "
        f"({wall_s / 60:.1f} min). Worker: --dtype float32 --num-threads 1 (the scheduler has the other core); "
        "scheduler: --no-prefix-caching. Constrained: the JSON schema `order` (an array of >= 64 objects), which "
        "cannot be complete before max_tokens; free: ignore_eos. Runs of one N interleave all four variants, the "
        "first changing each repetition; one stream's runs repeat 3x as often. Mask ms = the scheduler's "
        "`mask_ms` (computing the step's masks on the grammar engine's threads while the event loop waits or "
        "serves); with late masks it runs while the worker computes the forward. Late / inline mask rows: rows "
        "whose mask went in a StepMasks call after the step / in the Step itself."
    )
    return "\n\n".join(sections) + "\n\n" + notes


def plot(results: dict[str, Any], args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (model, by_variant) in zip(axes[0], results.items(), strict=True):
        labels = list(by_variant)
        width = 0.8 / len(labels)
        for k, label in enumerate(labels):
            xs = [i + k * width for i in range(len(args.streams))]
            ax.bar(xs, [mean(by_variant[label][n]["tok_s"]) for n in args.streams], width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(args.streams))], [f"{n} streams" for n in args.streams])
        ax.set_ylabel("output tok/s")
        ax.set_title(model)
        ax.legend(fontsize=7)
    save_plot(fig, NAME)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile-rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny model, 1 and 8 streams, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.models, args.streams, args.max_tokens, args.repeats, args.compile_rounds = ["tiny"], [1, 8], 16, 1, 1
    announce(NAME)
    started = time.perf_counter()
    paths = models(args.models)
    compiles = {name: compile_times(path, args.compile_rounds) for name, path in paths.items()}
    results = {name: measure(path, args) for name, path in paths.items()}
    body = report(results, compiles, args, time.perf_counter() - started)
    print(body)
    write_result(NAME, "Structured outputs: constrained vs unconstrained decoding, masks, compile time", body)
    plot(results, args)


if __name__ == "__main__":
    main()
