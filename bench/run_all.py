"""Run every benchmark (what `make bench` does): each module in BENCHMARKS below,
in order, as its own process, with the arguments `make bench` uses. Each prints
its table and writes bench/results/<name>.md and bench/results/<name>.png.

    python -m bench.run_all                 # all of them (~20 minutes on 2 CPU cores)
    python -m bench.run_all --only overhead prefix_cache
    python -m bench.run_all --list

Nothing is skipped silently: a module listed here but missing, one that fails,
or one that leaves no fresh results file or plot is reported as such in the
summary (bench/results/run_all.md) and makes the exit status non-zero; a
bench/*.py that is neither listed here nor in HELPERS stops the run before it
starts, so a new benchmark cannot be forgotten.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness.machine import announce, load_average
from bench.harness.results import RESULTS, markdown_table, write_result

BENCH = Path(__file__).resolve().parent
BUDGET_S = 20 * 60


@dataclass(frozen=True)
class Benchmark:
    name: str  # module bench/<name>.py, results bench/results/<name>.{md,png}
    args: tuple[str, ...]  # as `make bench` runs it (kept within the 20-minute budget)
    what: str
    plot: bool = True  # writes bench/results/<name>.png (checked)


# The one list. Issue 10's six sections first, then the others.
BENCHMARKS = [
    Benchmark("capacity", (), "issue 10 §1: paged vs contiguous backend at equal KV memory"),
    Benchmark("vs_transformers", ("--repeats", "2"), "issue 10 §2: vs transformers generate, batch 1/8/32, fp32+bf16"),
    Benchmark(
        "prefix_cache",
        ("--repeats", "6", "--burst-repeats", "2"),
        "issue 10 §3: 1,000-token shared system prompt, cache on vs off",
    ),
    Benchmark("chunked_prefill", (), "issue 10 §4: decode ITL while long prompts arrive, per chunk size"),
    Benchmark(
        "disaggregation",
        (),
        "issue 41: 1 prefill + 1 decode worker vs 2 unified while long prompts arrive; KV transfer GB/s",
    ),
    Benchmark("allocation_sim", (), "issue 10 §5: naive / dynamic / paged / paged+sharing allocators"),
    Benchmark(
        "overhead",
        ("--steps", "2", "--warmup", "1", "--e2e-seqs", "1", "64"),
        "issue 10 §6: planning, serialization, gRPC and forward per step",
    ),
    Benchmark("long_context", (), "issue 5: 200k-token prompt, KV bytes vs formula, memory, ITL per chunk"),
    Benchmark(
        "kv_quality",
        ("--text-tokens", "1536", "--gen-tokens", "64"),
        "KV precision: fp32/fp16/bf16/fp8/int8",
        plot=False,
    ),
    Benchmark("gateway_overhead", ("--requests", "10"), "HTTP gateway vs direct gRPC latency", plot=False),
    Benchmark("routing", ("--seeds", "2"), "prefix-aware routing vs round-robin, two workers", plot=False),
    Benchmark("scheduler_routing", ("--seeds", "2"), "gateway over two schedulers: prefix-aware vs random", plot=False),
    Benchmark(
        "step_wire",
        ("--repeats", "100"),
        "worker.v1 Step conversion + (de)serialization per step, both sides, vs the baseline revision",
        plot=False,
    ),
    Benchmark(
        "scheduler_step",
        ("--steps", "40", "--rounds", "2"),
        "the scheduler's CPU per decode step (plan, send, apply the result), vs the baseline revision",
        plot=False,
    ),
    Benchmark(
        "spec_decode",
        ("--streams", "1", "8", "--max-tokens", "64", "--repeats", "2"),
        "issue 30: speculative decoding on vs off, copy-heavy and free text, 1 and 8 streams",
    ),
    Benchmark(
        "structured",
        ("--models", "tiny", "--repeats", "2"),
        "issue 26: constrained vs unconstrained tok/s at 1 and 32 streams (late masks, held back), mask share",
    ),
    Benchmark(
        "long_prompt",
        (),
        "issue 35 §5: a running stream's largest gap and a short request's TTFT behind a 4,000-token prompt",
        plot=False,
    ),
    Benchmark(
        "structured_compile",
        ("--rounds", "5"),
        "issue 35 §1: a cold grammar compile in the sandbox vs in-process",
        plot=False,
    ),
    Benchmark("model_load", (), "issue 37: peak RSS while loading vs the checkpoint's size", plot=False),
    Benchmark(
        "kv_tiers",
        ("--conversations", "8", "--context-tokens", "256", "--tier1-conversations", "2"),
        "issue 41: a second KV tier vs recompute, multi-turn chat 4x the first tier",
    ),
    Benchmark(
        "lora",
        ("--repeats", "2"),
        "issue 40: tok/s with 0, 1, 4, 16 distinct LoRA adapters at 1 and 32 streams, adapter load time",
        plot=False,
    ),
    Benchmark(
        "moe",
        ("--rounds", "5", "--out", "moe"),
        "issue 37: MoE decode vs dense with equal active parameters",
        plot=False,
    ),
    Benchmark(
        "embeddings", ("--batches", "1", "64"), "issue 39: embeddings/s at batch 1 and 64 vs transformers", plot=False
    ),
    Benchmark(
        "itl_split",
        ("--rounds", "1", "--calls", "200"),
        "issue 38: one stream's time per token: worker forward, scheduler, gateway, client",
        plot=False,
    ),
    Benchmark(
        "first_start",
        ("--rounds", "1"),
        "issue 38: a first make serve's model preparation, the GGUF's tokenizer vs the conversion",
        plot=False,
    ),
    Benchmark(
        "loop",
        ("--max-tokens", "64", "--repeats", "1"),
        "serving loop: tiny model, 1-1024 streams, vs the baseline revision (git worktree)",
    ),
]
# Modules in bench/ that are not benchmarks (the shared harness is the package bench/harness/):
# stream_ceiling is the stub bench/loop.py measures against; structured_schemas, the schemas
# bench/structured.py constrains to (the structured-output tests use them too); gpu_check, `make gpu-check`'s driver (it runs pytest,
# compute-sanitizer and pip on a GPU machine, no services); kernel_resources, the ptxas
# report of the compiled kernels that gpu_check and tests/unit/test_kernel_resources.py read.
HELPERS = {"__init__", "run_all", "stream_ceiling", "structured_schemas", "gpu_check", "kernel_resources"}
# Benchmarks that need a GPU: `make bench-gpu` (gpu_serving) and `make gpu-check`'s
# wquant, gguf and kvcopy steps run them, not `make bench`.
GPU_ONLY = {"gpu_serving", "wquant_gemm", "gguf_gemm", "kv_offload_copy"}
# Benchmarks with a make target of their own (they install peers or run for long).
OWN_TARGET = {"peers", "quant_distance"}


def unlisted() -> list[str]:
    listed = {b.name for b in BENCHMARKS} | HELPERS | GPU_ONLY | OWN_TARGET
    return sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in listed)


def run(bench: Benchmark) -> tuple[str, float]:
    module = BENCH / f"{bench.name}.py"
    if not module.exists():
        return f"MISSING (bench/{bench.name}.py does not exist)", 0.0
    cmd = [sys.executable, "-m", f"bench.{bench.name}", *bench.args]
    print(f"\n=== {bench.name}: {bench.what}\n$ {' '.join(cmd[1:])}", flush=True)
    start = time.time()
    rc = subprocess.run(cmd, cwd=BENCH.parent).returncode
    elapsed = time.time() - start
    if rc != 0:
        return f"FAILED (exit status {rc})", elapsed
    stale = [
        f"{bench.name}{ext}"
        for ext in ((".md", ".png") if bench.plot else (".md",))
        if not (RESULTS / f"{bench.name}{ext}").exists() or (RESULTS / f"{bench.name}{ext}").stat().st_mtime < start
    ]
    if stale:
        return f"FAILED (no fresh {', '.join(stale)})", elapsed
    return "ok" if bench.plot else "ok (writes no plot)", elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these (names from --list)")
    parser.add_argument("--list", action="store_true", help="print the benchmarks and their arguments")
    args = parser.parse_args()
    if args.list:
        for b in BENCHMARKS:
            present = "" if (BENCH / f"{b.name}.py").exists() else "   [MISSING]"
            plot = "" if b.plot else " (no plot)"
            print(f"{b.name:18} {' '.join(b.args):40} {b.what}{plot}{present}")
        return 0
    if extra := unlisted():
        print(
            f"error: bench/{{{','.join(extra)}}}.py not listed in bench/run_all.py BENCHMARKS (nor HELPERS); "
            "add them so that `make bench` runs them",
            file=sys.stderr,
        )
        return 2
    chosen = BENCHMARKS
    if args.only:
        unknown = set(args.only) - {b.name for b in BENCHMARKS}
        if unknown:
            print(f"error: unknown benchmark(s) {sorted(unknown)}; see --list", file=sys.stderr)
            return 2
        chosen = [b for b in BENCHMARKS if b.name in args.only]
    announce("run_all")
    started, load_before = time.time(), load_average()
    rows, failed = [], 0
    for bench in chosen:
        status, elapsed = run(bench)
        failed += not status.startswith("ok")
        rows.append(
            [
                bench.name,
                status,
                f"{elapsed:.0f}",
                f"`python -m bench.{bench.name} {' '.join(bench.args)}`".replace(" `", "`"),
                f"[{bench.name}.md]({bench.name}.md)",
                f"[{bench.name}.png]({bench.name}.png)" if bench.plot else "none",
            ]
        )
        print(f"=== {bench.name}: {status} in {elapsed:.0f} s (total so far {time.time() - started:.0f} s)", flush=True)
    total = time.time() - started
    table = markdown_table(["benchmark", "status", "seconds", "command", "results", "plot"], rows)
    notes = (
        f"Total {total:.0f} s ({total / 60:.1f} min; budget {BUDGET_S // 60} min"
        + (", **over budget**" if total > BUDGET_S else "")
        + f"); {failed} failed or missing. "
        f"1-minute load average {load_before:.1f} before, {load_average():.1f} after (2 cores, shared)."
    )
    print("\n" + table + "\n\n" + notes)
    if not args.only:
        print(f"wrote {write_result('run_all', 'All benchmarks (make bench)', table, notes)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
