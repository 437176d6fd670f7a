"""Multi-LoRA throughput on the CPU (issue 40): one scheduler + worker with
--enable-lora, the same greedy requests with 0 (the base alone), 1, 4 and 16 distinct
adapters in the batch, at 1 and 32 streams, side by side in one run; and the time to
load an adapter onto the worker.

    python -m bench.lora [--streams 1 32] [--adapters 0 1 4 16] [--max-tokens 32] [--repeats 2]
    python -m bench.lora --quick      # smoke test: 1 and 4 streams, 0 and 4 adapters, 8 tokens

Adapters: rank 8 on q/k/v/o and gate/up/down (PEFT's files, A and B drawn at random:
tools/tiny_adapters.py) for SmolLM2-135M-Instruct, built once into .cache/bench_lora.
The worker has --max-loras 16 (every adapter resident after the warm-up, so the runs
measure the mixed forward, not loads); stream i runs adapter i mod k. Load time: the
scheduler's pagedserve_lora_adapter_load_seconds_total over its loads (the worker.v1
LoadAdapter call with the files' bytes, from the scheduler's side).
Target (CPU): 4 adapters mixed >= 0.75x the base's tok/s at 32 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness.load import drive, text_words
from bench.harness.machine import announce, load_average
from bench.harness.results import markdown_table, mean, spread, write_result
from bench.harness.services import DEFAULT_MODEL, REPO, Stack, require_model
from tools.ports import free_port

NAME = "lora"
RANK = 8
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapters(model: Path, count: int) -> list[Path]:
    """`count` PEFT adapters of the model, built once (each its own seed)."""
    from tools.tiny_adapters import AdapterSpec, build_adapter

    root = REPO / ".cache" / "bench_lora" / model.name
    out = []
    for i in range(count):
        path = root / f"r{RANK}_all_{i}"
        if not (path / "adapter_model.safetensors").exists():
            build_adapter(model, path, AdapterSpec(rank=RANK, alpha=2 * RANK, target_modules=MODULES), seed=i)
        out.append(path)
    return out


def prompts(n: int, seed: int) -> list[list[int]]:
    """n distinct 48-token prompts of real words' ids (no prefix is shared)."""
    words = text_words()
    return [
        [100 + (sum(map(ord, words[(seed * 97 + i * 13 + j) % len(words)])) * 31 + j) % 20000 for j in range(48)]
        for i in range(n)
    ]


def lora_totals(url: str) -> tuple[float, float]:
    """(loads, load seconds) from the scheduler's metrics."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        for name in ("pagedserve_lora_adapter_loads_total", "pagedserve_lora_adapter_load_seconds_total"):
            if line.startswith(name + "{"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values.get("pagedserve_lora_adapter_loads_total", 0.0), values.get(
        "pagedserve_lora_adapter_load_seconds_total", 0.0
    )


def run_once(stack: Stack, n: int, k: int, max_tokens: int, seed: int) -> dict[str, Any]:
    ids = prompts(n, seed)

    async def streams() -> Any:
        if k == 0:
            return await drive(stack.scheduler_address, ids, max_tokens)
        runs = await asyncio.gather(
            *(drive(stack.scheduler_address, [p], max_tokens, {"ignore_eos": True, "lora_adapter": f"a{i % k}"})
              for i, p in enumerate(ids))
        )  # fmt: skip
        return runs

    load = load_average()
    started = time.perf_counter()
    out = asyncio.run(streams())
    wall = time.perf_counter() - started
    tokens = out.tokens if k == 0 else sum(r.tokens for r in out)
    return {"tok_s": tokens / wall, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smoke test")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.adapters, args.max_tokens, args.repeats = [1, 4], [0, 4], 8, 1
    announce(NAME)
    started = time.perf_counter()
    model = require_model(DEFAULT_MODEL)
    paths = adapters(model, max(args.adapters))
    lora = ["--enable-lora", "--max-loras", "16", "--max-lora-rank", str(RANK)]
    port = free_port()
    worker = ["--model", str(model), "--dtype", "bfloat16", "--num-blocks", "2048", "--num-threads", "1", *lora]
    modules = [f"a{i}={p}" for i, p in enumerate(paths)]
    scheduler = ["--model", str(model), "--no-prefix-caching", "--admin-port", "-1", "--metrics-port", str(port),
                 *lora, "--lora-modules", *modules]  # fmt: skip
    stack = Stack(NAME, REPO, worker, scheduler).start()
    runs: dict[tuple[int, int], list[dict[str, Any]]] = {}
    try:
        for k in sorted(set(args.adapters)):  # warm-up: every adapter loaded once, both step shapes
            run_once(stack, max(k, 2), k, 4, seed=99)
        loads, load_s = lora_totals(f"http://127.0.0.1:{port}/metrics")
        for j in range(args.repeats):
            for n in args.streams:
                order = args.adapters if j % 2 == 0 else list(reversed(args.adapters))
                for k in order:
                    r = run_once(stack, n, k, args.max_tokens, seed=1000 * j + n)
                    runs.setdefault((n, k), []).append(r)
                    print(f"N={n:3} adapters={k:2}: {r['tok_s']:7.1f} tok/s, load {r['load']:.1f}", flush=True)
    finally:
        stack.stop()
    rows = []
    for n in args.streams:
        base = mean(r["tok_s"] for r in runs[n, 0]) if (n, 0) in runs else None
        for k in args.adapters:
            tok_s = [r["tok_s"] for r in runs[n, k]]
            ratio = f"**{mean(tok_s) / base:.2f}x**" if base else ""
            rows.append([n, k or "base", spread(tok_s, ".1f"), ratio, f"{mean(r['load'] for r in runs[n, k]):.1f}"])
    table = markdown_table(["streams", "distinct adapters", "tok/s", "vs base", "load avg"], rows)
    body = (
        f"{table}\n\nAdapter load (worker.v1 LoadAdapter with the files, rank {RANK} on all 7 projections of 30 "
        f"layers): {1e3 * load_s / max(loads, 1):.0f} ms mean over {loads:.0f} loads.\n\n"
        f"Model SmolLM2-135M-Instruct, worker --dtype bfloat16 --num-threads 1 --max-loras 16, scheduler "
        f"--no-prefix-caching; greedy, ignore_eos, {args.max_tokens} tokens each, 48-token prompts; tok/s: mean "
        f"(min-max) of {args.repeats} repetitions, the adapter counts in alternating order. "
        f"Wall time {(time.perf_counter() - started) / 60:.1f} min. Target: 4 adapters >= 0.75x base at 32 streams."
    )
    print(body)
    notes = (
        "Smoke test (--quick): short runs, one repetition; not the issue's measurement (32 streams, 0/1/4/16 "
        "adapters, which the default arguments run)."
        if args.quick
        else ""
    )
    write_result(NAME, "Multi-LoRA: tok/s with 0, 1, 4, 16 distinct adapters in the batch, and load time", body, notes)


if __name__ == "__main__":
    main()
