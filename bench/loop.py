"""The serving loop under load: real scheduler + worker processes on 127.0.0.1,
one asyncio gRPC client driving N concurrent Generate streams, on the tiny
2-layer hidden-64 Llama checkpoint (fp32), so that the model is cheap and the
loop around it (planning, protos, gRPC, streaming) is what is measured; the same
workload against a baseline revision in a temporary git worktree, in the same run.

    python -m bench.loop [--streams 1 64 256 1024] [--max-tokens 128] [--baseline REV | --no-baseline]
    python -m bench.loop --quick        # smoke test (~20 s)
    python -m bench.loop --current HEAD # 'current' from a clean worktree of HEAD, not this working tree

'current' is this working tree by default (uncommitted changes to the service
code are listed in the results); --current REV runs it from REV in a temporary
worktree as well. Part B runs in a child process started from the same tree.

Workload: N prompts of 40-80 random token ids (seeded), 128 greedy tokens each
with ignore_eos; scheduler flags --max-num-seqs 256 --max-num-batched-tokens 8192
--no-prefix-caching (and --max-waiting 2048, so that 1024 streams arriving at once
queue instead of being refused). N = 1024 > max-num-seqs: requests queue.
The worker runs on CPU (--device cuda passes the worker's --device flag).

Part A, end to end (both revisions; their processes are started from their own
tree with `python -m worker_svc` / `python -m scheduler_svc`, the same code path):
* output tok/s: completion tokens received by the client / wall time from the
  first Generate call to the last stream's end;
* ITL p50/p99: gaps between consecutive token-carrying messages of one stream,
  measured in the client (perf_counter on arrival), pooled over all streams;
* step period: the scheduler runs with JSON logs at debug level and logs one
  "step" line per step (same line in both revisions); period = time between
  consecutive lines (the whole loop: dispatch + streaming of the previous step,
  planning, the Step RPC, update). "mean" = all steps of the run; "decode" =
  steps that only decode. The same lines give the scheduler's step_ms (RPC +
  update) and the worker's forward_ms (from its StepResponse);
* scheduler CPU per step: the scheduler process's CPU time (user + system, from
  /proc) over the run / its steps: what the loop costs it, unaffected by other
  processes on the shared cores (and the same for the worker).

Part B, where a step's time goes (current revision only: it imports the
scheduler's planning/engine modules, whose paths change between revisions):
bench/harness/step_driver.py runs the scheduler's own Planner + KVCacheManager in
this process on the same workload (batch = min(N, max-num-seqs)) and drives a
real worker process over gRPC as the scheduler does, with RequestStreams on the
output side; after the prefill, per decode step: plan (Planner.schedule), build
(plan_to_proto), encode (SerializeToString), RPC (unary call wall time), parse
reply (FromString + result_from_proto), update (Planner.update), dispatch
(RequestStream.on_update per update, as EngineCore._dispatch), responses
(event_to_proto + SerializeToString per stream event, as the Generate handler).
Worker figures come from its StepResponse timings: batch = prepare_ms (block
copies + forward-batch building), forward_ms, sample_ms; its request parsing
and validation and its reply encoding are timed here on the same bytes with the
same code; RPC transport = RPC wall - worker total_ms - those three.

Part C, the ceiling: the same client and workload against bench/stream_ceiling.py,
a serving.v1 stub that streams one-token messages with nothing behind it: what
one Python gRPC server process can stream on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from datetime import datetime
from pathlib import Path

from bench.harness.load import drive, random_prompts
from bench.harness.machine import announce, cpu_seconds, load_average
from bench.harness.results import (
    commit,
    fmt,
    markdown_table,
    mean,
    ms_since,
    percentile,
    pyplot,
    save_plot,
    write_result,
)
from bench.harness.services import (
    REPO,
    Stack,
    TreeService,
    dirty_files,
    make_worktree,
    remove_worktree,
    rev_of,
    run_in_tree,
    tiny_model,
)

NAME = "loop"
DEFAULT_BASELINE = "1b3f5f4"
MAX_NUM_SEQS = 256
SCHEDULER_FLAGS = [
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-num-batched-tokens",
    "8192",
    "--no-prefix-caching",
    "--max-waiting",
    "2048",
    "--admin-port",
    "-1",
]
SHORT_RUN_REPEATS = 4
NUM_BLOCKS = 4096  # 256 running x ceil(208 / 16) = 3,328 blocks at most


def prompts_for(n: int, seed: int, vocab: int) -> list[list[int]]:
    return random_prompts(n, seed, 4, vocab, (40, 80))


def timestamp(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"]).timestamp()


def run_once(stack: Stack, n: int, max_tokens: int, vocab: int) -> dict:
    """One run of the workload: what the client saw, the scheduler's step lines, and
    the CPU time each service spent on it."""
    seen = len(stack.step_lines())
    load = load_average()
    pids = {"scheduler": stack.scheduler.proc.pid, "worker": stack.worker.proc.pid}
    cpu_before = {k: cpu_seconds(pid) for k, pid in pids.items()}
    out = asyncio.run(drive(stack.scheduler_address, prompts_for(n, n, vocab), max_tokens))
    time.sleep(0.05)  # the last step's line is written before its tokens go out; be safe
    cpu = {k: cpu_seconds(pid) - cpu_before[k] for k, pid in pids.items()}
    steps = stack.step_lines()[seen:]
    times = [timestamp(s) for s in steps]
    return {
        "tok_s": out.tok_s,
        "wall_s": out.wall_s,
        "gaps": out.gaps_ms,
        "load": load,
        "steps": steps,
        "sched_cpu_ms": 1e3 * cpu["scheduler"] / max(len(steps), 1),
        "worker_cpu_ms": 1e3 * cpu["worker"] / max(len(steps), 1),
        "periods": [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)],
        "decode_periods": [
            (b - a) * 1e3 for a, b, s in zip(times, times[1:], steps[1:], strict=False) if s["tokens"] == s["seqs"]
        ],
    }


def repeats_for(n: int, repeats: int) -> int:
    """A single stream's run lasts well under a second, so noise dominates it: it repeats 4x as often."""
    return repeats * SHORT_RUN_REPEATS if n == 1 else repeats


def stream_ceiling(streams: list[int], max_tokens: int, vocab: int, repeats: int) -> dict[int, float]:
    """Part C: output tok/s of the same client and workload against bench/stream_ceiling.py,
    a serving.v1 stub that only streams (no scheduler, no worker)."""
    stub = TreeService(REPO, "bench.stream_ceiling", []).start()
    try:
        asyncio.run(drive(stub.address, prompts_for(8, 8, vocab), 8))  # warm-up, as for the stacks
        rates = {}
        for n in streams:
            runs = [asyncio.run(drive(stub.address, prompts_for(n, n, vocab), max_tokens)) for _ in range(repeats)]
            rates[n] = mean(r.tok_s for r in runs)
        return rates
    finally:
        stub.stop()


def summarize(runs: list[dict]) -> dict:
    """Repeated runs: tok/s is their mean; periods and ITL percentiles are over the steps and gaps of all."""
    gaps = [g for r in runs for g in r["gaps"]]
    decode_steps = [s for r in runs for s in r["steps"] if s["tokens"] == s["seqs"]]
    return {
        "tok_s": mean(r["tok_s"] for r in runs),
        "tok_s_all": [r["tok_s"] for r in runs],
        "wall_s": mean(r["wall_s"] for r in runs),
        "load": mean(r["load"] for r in runs),
        "itl_p50": percentile(gaps, 50),
        "itl_p99": percentile(gaps, 99),
        "steps": mean(len(r["steps"]) for r in runs),
        "period": mean(p for r in runs for p in r["periods"]),
        "period_decode": mean(p for r in runs for p in r["decode_periods"]),
        "step_ms": mean(s["step_ms"] for s in decode_steps),
        "forward_ms": mean(s["forward_ms"] for s in decode_steps),
        "seqs_per_step": mean(s["seqs"] for s in decode_steps),
        "sched_cpu_ms": mean(r["sched_cpu_ms"] for r in runs),
        "worker_cpu_ms": mean(r["worker_cpu_ms"] for r in runs),
    }


# ---- part B: in-process split (current revision) ----------------------------------------
def split(worker_address: str, model: Path, batch: int, max_tokens: int, vocab: int, steps: int) -> dict:
    """The step path piece by piece (bench/harness/step_driver.py), plus the output side
    as the engine runs it: RequestStream.on_update per update (EngineCore._dispatch) and
    event_to_proto + serialize per event (the Generate handlers)."""
    from bench.harness.step_driver import StepDriver, transport_ms
    from scheduler_svc.api.serving import event_to_proto
    from scheduler_svc.engine.streams import RequestStream
    from scheduler_svc.request import Request, SamplingOptions
    from scheduler_svc.text.tokenizer import load_tokenizer

    driver = StepDriver(worker_address, MAX_NUM_SEQS, prefix_caching=False)
    try:
        tokenizer = load_tokenizer(model)
        sampling = SamplingOptions(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        eos = frozenset(tokenizer.eos_token_ids)
        requests = [Request(f"r{i}", i, ids, sampling, eos) for i, ids in enumerate(prompts_for(batch, batch, vocab))]
        driver.add(requests)
        streams = {r.request_id: RequestStream(r, tokenizer) for r in requests}
        measured = []
        while driver.planner.has_work() and len(measured) < steps:
            step = driver.step()
            t = step.t
            start = time.perf_counter()
            for update in step.updates:  # as EngineCore._dispatch
                stream = streams.get(update.request_id)
                if stream is None:
                    continue
                stream.on_update(update)
                if stream.closed:
                    del streams[update.request_id]
            t["dispatch"] = ms_since(start)
            start = time.perf_counter()
            for stream in list(streams.values()):  # as the Generate handlers, one event_to_proto per event
                while not stream.events.empty():
                    event_to_proto(stream.events.get_nowait(), stream.request.request_id, tokenizer).SerializeToString()
            t["responses"] = ms_since(start)
            t |= driver.worker_costs(step)
            t["transport"] = transport_ms(t)
            if step.plan.num_tokens == len(step.plan.seqs) == batch:  # a decode step of the whole batch
                measured.append(t)
        driver.planner.requeue_all()
        if not measured:
            raise RuntimeError(f"no decode step of {batch} sequences")
        return {k: mean(s[k] for s in measured) for k in measured[0]} | {"steps": len(measured)}
    finally:
        driver.close()


def split_in(root: Path, worker_address: str, model: Path, batches: list[int], args) -> dict[int, dict]:
    """Part B in a child process started from `root`, so it imports the same code as that tree's services."""
    argv = ["-m", "bench.loop", "--split-only", worker_address, "--model", str(model)]
    argv += ["--streams", *map(str, batches), "--max-tokens", str(args.max_tokens)]
    argv += ["--split-steps", str(args.split_steps)]
    return {int(k): v for k, v in run_in_tree(root, argv, "SPLIT").items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="revision to compare against (git worktree)")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--current",
        default="",
        metavar="REV",
        help="run 'current' from this revision in a git worktree too (default: this working tree, "
        "uncommitted changes included; they are listed in the results)",
    )
    parser.add_argument("--device", default="cpu", help="the worker's --device")
    parser.add_argument("--worker-threads", type=int, default=1, help="the worker's --num-threads (2-core machine)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per (revision, N), alternating revisions")
    parser.add_argument("--split-steps", type=int, default=24, help="decode steps measured in part B per batch")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 1/16/64 streams, 16 tokens, 1 repeat, 4 split steps"
    )
    parser.add_argument("--model", default="", help="checkpoint (default: the tiny Llama, built if missing)")
    parser.add_argument("--split-only", default="", help=argparse.SUPPRESS)  # part B's child process
    args = parser.parse_args()
    if args.quick:
        args.streams, args.max_tokens, args.split_steps, args.repeats = [1, 16, 64], 16, 4, 1
    model = Path(args.model).resolve() if args.model else tiny_model("llama")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    if args.split_only:
        parts = {b: split(args.split_only, model, b, args.max_tokens, vocab, args.split_steps) for b in args.streams}
        print("SPLIT " + json.dumps(parts))
        return
    announce(NAME)
    worker_args = [
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--num-blocks",
        str(NUM_BLOCKS),
        "--num-threads",
        str(args.worker_threads),
        "--device",
        args.device,
    ]
    started, load_before = time.perf_counter(), load_average()
    baseline_rev = None if args.no_baseline else rev_of(args.baseline)
    current_rev = rev_of(args.current) if args.current else None
    worktrees: list[Path] = []
    stacks: list[Stack] = []
    e2e: dict[str, dict[int, dict]] = {"current": {}, "baseline": {}}
    parts: dict[int, dict] = {}
    ceiling: dict[int, float] = {}
    try:
        current_root = REPO
        if current_rev:
            current_root = make_worktree(current_rev)
            worktrees.append(current_root)
        dirty = [] if current_rev else dirty_files(REPO, "bench")
        scheduler_args = ["--model", str(model), *SCHEDULER_FLAGS]
        stacks.append(Stack("current", current_root, worker_args, scheduler_args).start())
        if baseline_rev:
            worktrees.append(make_worktree(baseline_rev))
            stacks.append(Stack("baseline", worktrees[-1], worker_args, scheduler_args).start())
        for stack in stacks:  # warm-up: first-call costs (torch kernels, gRPC channels) out of the figures
            run_once(stack, 8, 8, vocab)
        for i, n in enumerate(args.streams):
            runs = {stack.label: [] for stack in stacks}
            for j in range(repeats_for(n, args.repeats)):
                order = stacks if (i + j) % 2 == 0 else stacks[::-1]  # alternate who goes first
                for stack in order:
                    runs[stack.label].append(run_once(stack, n, args.max_tokens, vocab))
            for stack in stacks:
                r = summarize(runs[stack.label])
                e2e[stack.label][n] = r
                print(
                    f"{stack.label:8} N={n:5}: {r['tok_s']:8.0f} tok/s, period {r['period']:.2f} ms "
                    f"(decode {r['period_decode']:.2f}), ITL p50 {r['itl_p50']:.2f} p99 {r['itl_p99']:.2f} ms, "
                    f"{r['steps']} steps, {r['wall_s']:.1f} s, scheduler CPU {r['sched_cpu_ms']:.2f} ms/step",
                    flush=True,
                )
        for stack in stacks[1:]:
            stack.stop()
        del stacks[1:]
        ceiling = stream_ceiling(args.streams, args.max_tokens, vocab, args.repeats)
        for n, rate in ceiling.items():
            print(f"stub    N={n:5}: {rate:8.0f} tok/s (gRPC streaming alone)", flush=True)
        # Part B on the current worker process (idle now; prefix caching is off, so no stale block is read).
        batches = sorted({min(n, MAX_NUM_SEQS) for n in args.streams})
        parts = split_in(current_root, stacks[0].worker.address, model, batches, args)
        for batch, p in parts.items():
            print(
                f"split B={batch}: plan {p['plan']:.2f} build {p['build']:.2f} encode {p['encode']:.2f} "
                f"rpc {p['rpc']:.2f} (worker {p['w_total']:.2f}) update {p['update']:.2f} dispatch "
                f"{p['dispatch']:.2f} responses {p['responses']:.2f} ms",
                flush=True,
            )
    finally:
        for stack in stacks:
            stack.stop()
        for path in worktrees:
            remove_worktree(path)
    load_after = load_average()
    current_desc = (
        f"`{current_rev}` (a clean git worktree)"
        if current_rev
        else "this working tree"
        + (
            f", with uncommitted changes to {', '.join(f'`{d}`' for d in dirty)}"
            if dirty
            else " (no uncommitted changes to the service code)"
        )
    )
    report(
        args,
        model,
        e2e,
        parts,
        ceiling,
        baseline_rev,
        current_desc,
        load_before,
        load_after,
        time.perf_counter() - started,
        current_rev,
    )


def report(
    args, model, e2e, parts, ceiling, baseline_rev, current_desc, load_before, load_after, elapsed, current_rev=None
) -> None:
    cur, base = e2e["current"], e2e["baseline"]
    has_base = bool(base)

    def pair(n, key, digits=1, higher_better=True):
        c = cur[n][key]
        if not has_base:
            return [fmt(c, digits)]
        b = base[n][key]
        ratio = c / b if b else math.nan
        return [fmt(b, digits), fmt(c, digits), f"{ratio:.2f}x"]

    heads = ["streams N"]
    whats = ("output tok/s", "step period ms (mean)", "decode step period ms", "ITL p50 ms", "ITL p99 ms")
    for what in (*whats, "scheduler CPU ms per step"):
        heads += [f"{what} base", f"{what} current", "ratio"] if has_base else [what]
    rows = []
    for n in args.streams:
        rows.append(
            [
                n,
                *pair(n, "tok_s", 0),
                *pair(n, "period", 2),
                *pair(n, "period_decode", 2),
                *pair(n, "itl_p50", 2),
                *pair(n, "itl_p99", 2),
                *pair(n, "sched_cpu_ms", 2),
            ]
        )
    table_a = markdown_table(heads, rows)
    rows_x = []
    for label, res in (("baseline", base), ("current", cur)):
        for n in args.streams:
            if n in res:
                r = res[n]
                rows_x.append(
                    [
                        label,
                        n,
                        fmt(r["steps"], 0),
                        " / ".join(f"{x:.0f}" for x in r["tok_s_all"]),
                        fmt(r["seqs_per_step"], 0),
                        fmt(r["period_decode"], 2),
                        fmt(r["step_ms"], 2),
                        fmt(r["forward_ms"], 2),
                        fmt(r["period_decode"] - r["step_ms"], 2),
                        fmt(r["sched_cpu_ms"], 2),
                        fmt(r["worker_cpu_ms"], 2),
                        fmt(r["wall_s"], 1),
                        fmt(r["load"], 1),
                    ]
                )
    table_x = markdown_table(
        [
            "revision",
            "N",
            "steps per run",
            "tok/s of each run",
            "seqs per decode step",
            "decode step period ms",
            "scheduler step_ms (RPC + update)",
            "worker forward_ms",
            "period - step_ms (plan + dispatch + streaming out + loop)",
            "scheduler CPU ms per step",
            "worker CPU ms per step",
            "run s",
            "load avg at start",
        ],
        rows_x,
    )
    rows_b = []
    for batch, p in parts.items():
        sched = p["plan"] + p["build"] + p["encode"] + p["parse_reply"] + p["update"] + p["dispatch"] + p["responses"]
        total = sched + p["rpc"]
        rows_b.append(
            [
                batch,
                p["steps"],
                fmt(p["plan"], 2),
                fmt(p["build"] + p["encode"], 2),
                f"{fmt(p['build'], 2)} + {fmt(p['encode'], 2)}",
                fmt(p["transport"], 2),
                fmt(p["w_parse"] + p["w_validate"] + p["w_prepare"], 2),
                f"{fmt(p['w_parse'] + p['w_validate'], 2)} + {fmt(p['w_prepare'], 2)}",
                fmt(p["w_forward"], 2),
                fmt(p["w_sample"], 2),
                fmt(p["w_reply"], 2),
                fmt(p["parse_reply"] + p["update"], 2),
                fmt(p["dispatch"] + p["responses"], 2),
                f"{fmt(p['dispatch'], 2)} + {fmt(p['responses'], 2)}",
                fmt(total, 2),
                f"{100 * (total - p['w_forward'] - p['w_sample']) / total:.0f}%",
            ]
        )
    table_b = markdown_table(
        [
            "batch (seqs)",
            "steps",
            "plan ms",
            "build + encode Step ms",
            "(build + encode)",
            "RPC transport ms",
            "worker validation + batch ms",
            "(parse+validate + prepare)",
            "forward ms",
            "sampling ms",
            "worker reply encode ms",
            "parse reply + update ms",
            "output streaming ms",
            "(dispatch + responses)",
            "step total ms",
            "not forward/sampling",
        ],
        rows_b,
    )
    table_c = markdown_table(
        ["streams N", "stub tok/s (gRPC streaming only)", "current tok/s", "current / stub"],
        [[n, fmt(ceiling[n], 0), fmt(cur[n]["tok_s"], 0), f"{cur[n]['tok_s'] / ceiling[n]:.2f}"] for n in ceiling],
    )
    shown_model = model.relative_to(REPO) if model.is_relative_to(REPO) else model
    quick = " (**--quick smoke test**: fewer streams and tokens)" if args.quick else ""
    tables = (
        f"### A. End to end: output tok/s, step period, ITL{quick}\n\n"
        + (
            f"Baseline = `{baseline_rev}` (before this work), current = {current_desc}; "
            f"ratio = current / baseline "
            f"(tok/s: higher is better; periods and ITL: lower is better).\n\n"
            if has_base
            else ""
        )
        + f"{table_a}\n\nPer decode step, from the scheduler's step log lines:\n\n{table_x}\n\n"
        + f"### B. Where a decode step's time goes (current revision, in process + real worker; means of "
        f"{args.split_steps} decode steps of the whole batch)\n\n{table_b}\n\n"
        + "### C. The ceiling: the same client against a serving.v1 stub that only streams\n\n"
        + f"{table_c}\n"
    )
    notes = (
        f"Current = {current_desc}"
        + (f"; baseline = `{baseline_rev}`" if has_base else "")
        + "."
        + (
            f" (The 'commit' line above is HEAD when this file was written, `{commit()}`; the code measured as "
            f"current is `{current_rev}`.)"
            if current_rev and not commit().startswith(current_rev)
            else ""
        )
        + "\n\n"
        f"Workload: tiny 2-layer hidden-64 Llama (`{shown_model}`, "
        f"vocab 768), fp32, worker on {args.device} with --num-threads {args.worker_threads} and {NUM_BLOCKS} blocks; "
        f"scheduler `{' '.join(SCHEDULER_FLAGS)}` with JSON logs at debug level (one 'step' line per step, in both "
        f"revisions); prompts of 40-80 random token ids, {args.max_tokens} greedy tokens each with ignore_eos; one "
        f"asyncio grpc.aio client in the bench process driving N concurrent Generate streams; all on 127.0.0.1, "
        f"client, scheduler and worker sharing the machine's cores. Each (revision, N) ran {args.repeats} time(s) ({args.repeats * SHORT_RUN_REPEATS} for N = 1, whose runs last under a second), "
        f"alternating which revision goes first, after a warm-up run of 8 streams x 8 tokens on each stack; both "
        f"stacks were up for the whole of part A (the idle one only probes its worker once a second).\n\n"
        f"How each figure is measured: **output tok/s** = completion tokens received by the client / wall time from "
        f"the first Generate call to the last stream's end (prefill and queueing included). **ITL p50/p99** = gaps "
        f"between consecutive token-carrying messages of one stream, taken in the client on arrival, pooled over all "
        f"streams. **Step period** = time between consecutive 'step' log lines of the scheduler (ISO timestamps, us): "
        f"one full turn of the per-worker loop (output streaming of the previous step, planning, Step RPC, update); "
        f"'mean' over all steps of the run, 'decode' over steps that only decode. 'scheduler step_ms' and 'worker "
        f"forward_ms' are the fields of the same log lines (step_ms = the RPC + Planner.update; forward_ms = the "
        f"worker's forward from its StepResponse). **Scheduler (worker) CPU ms per step** = the CPU time (user + "
        f"system, /proc/<pid>/stat) the scheduler (worker) process used during the run / the steps it logged: its own "
        f"cost per step, which other processes on the shared cores do not inflate as they do wall time. Part B (current revision only; the baseline's modules live at other "
        f"paths, so only part A ran for it): this process runs the scheduler's own Planner + KVCacheManager (prefix "
        f"caching off) and RequestStreams on the same prompts (batch = min(N, {MAX_NUM_SEQS})) and sends each step to "
        f"the real worker process over gRPC as serialized bytes; plan = Planner.schedule; build = plan_to_proto; "
        f"encode = SerializeToString; RPC transport = RPC wall time - worker total_ms - worker parse+validate - worker "
        f"reply encode; worker validation + batch = step_from_proto + step_input.validate (the worker's code on the "
        f"same bytes, timed here) + prepare_ms (block copies + forward-batch building, from StepResponse.timings); "
        f"forward = forward_ms (model + logits), sampling = sample_ms (StepResponse.timings); parse reply + update = "
        f"StepResponse.FromString + result_from_proto + Planner.update; output streaming = RequestStream.on_update per "
        f"update (EngineCore._dispatch) + event_to_proto + SerializeToString per event (the Generate handler's part; "
        f"gRPC's own write of each message on the asyncio loop is not in B, it is in part A's period). "
        f"'not forward/sampling' = share of the step total spent outside the model. Part C: the same client, "
        f"prompts and max_tokens against `bench/stream_ceiling.py`, a serving.v1 stub in its own process whose "
        f"Generate yields max_tokens one-token messages as fast as gRPC takes them (no scheduler, worker or "
        f"tokenizer): what one Python gRPC server streams to this client on this machine, the most the loop could "
        f"deliver with one message per token.\n\n"
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after (the machine is shared: other "
        f"engineers' tests may have been running). Run time {elapsed:.0f} s."
    )
    print("\n" + tables + "\n" + notes)
    plot(args, e2e, baseline_rev)
    title = "The serving loop: tiny model, N concurrent streams, baseline vs current"
    print(f"wrote {write_result(NAME, title, tables, notes)}")


def plot(args, e2e, baseline_rev) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, res, style in (("current", e2e["current"], "o-"), (f"baseline {baseline_rev}", e2e["baseline"], "s--")):
        ns = [n for n in args.streams if n in res]
        if not ns:
            continue
        left.plot(ns, [res[n]["tok_s"] for n in ns], style, label=label)
        right.plot(ns, [res[n]["period_decode"] for n in ns], style, label=label)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.streams, [str(n) for n in args.streams])
        ax.set_xlabel("concurrent streams")
        ax.axvline(MAX_NUM_SEQS, color="grey", linestyle=":", linewidth=1)
        ax.legend(fontsize=8)
    left.set_ylabel("output tokens/s")
    left.set_title("throughput (tiny Llama, 128 tokens per stream)")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.set_title("decode step period (scheduler loop)")
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
