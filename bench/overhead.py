"""Where a decode step's time goes: scheduler planning, proto building and
serialization, the gRPC round trip and the worker's forward, at 1, 64 and 256
sequences with 2k-token contexts, on the default model; the same step called
in-process for comparison; and the same batch through the real services.

    python -m bench.overhead [--seqs 1 64 256] [--context 2048] [--steps 5] [--e2e-seqs 1 64 256]

Part A, attribution (one bench process driving a real worker process, through
bench/harness/step_driver.py): the scheduler's own Planner + KVCacheManager run
in this process and plan real steps; each plan goes to a real worker process
over gRPC exactly as the scheduler sends it (plan_to_proto, serialized bytes on
a plain unary call), and the result is applied with Planner.update.
The N sequences are 2,048-token prompts sharing their first 2,032 tokens (the
prefix cache shares those 127 blocks; each computes its own last 16), so 256
sequences x 2k contexts fit in memory: every sequence still attends over its
whole 2k context (the attention gathers it per sequence). After the prefill,
--warmup decode steps, then --steps measured ones. Per step:

* plan: Planner.schedule(); update: Planner.update() with the sampled tokens;
* to proto + serialize: plan_to_proto(plan).SerializeToString();
* RPC: the unary call's wall time; within it the worker reports its execute
  time (prepare + forward + sample; `total_ms` of its StepTimings); the worker's
  request parsing (StepRequest.FromString + step_from_proto), validation
  (step_input.validate) and reply building (step_to_proto + serialize) are
  timed here on the same bytes with the same code; the rest of the RPC is gRPC
  transport and server framework;
* parse reply: StepResponse.FromString + result_from_proto;
* in-process: a second Worker object in this process runs the same step
  (Worker.step on the plan's StepInput: validation + execute) on a pool thread,
  as the worker process runs it on a gRPC server thread, alternating with the
  RPC (who goes first flips every step). (On this shared 2-vCPU VM, torch's
  2-thread OpenMP regions started from the main thread stall badly under CPU
  contention: the same decode step took 5-25x longer there than on a thread.)

Part B, end to end: a real worker + scheduler pair (debug JSON logs), N
concurrent streams with the same contexts; per pure-decode step of all N
sequences, the scheduler's step period (time between its consecutive "step"
log lines: planning, RPC, update and streaming the tokens to the clients, the
whole loop) against the worker's execute time for that step (its "step done"
line). The client process reading the N streams shares the 2 cores.

Goal (issue 10): scheduler + RPC overhead <= 10% of step time at 64 sequences.
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from bench.harness.load import random_token_ids
from bench.harness.machine import announce, load_average
from bench.harness.results import fmt, markdown_table, median, ms_since, progress, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, Cluster, ServiceProcess, log_events, require_model
from bench.harness.step_driver import StepDriver, transport_ms
from scheduler_svc.client import SchedulerClient
from scheduler_svc.planning.plan import StepPlan
from scheduler_svc.request import Request, SamplingOptions
from worker_svc.config import WorkerConfig
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput
from worker_svc.worker import Worker

NAME = "overhead"
GOAL_SHARE = 0.10
GOAL_SEQS = 64
BLOCK = 16


def prompts_for(n: int, context: int, rng: random.Random) -> list[list[int]]:
    """n prompts of `context` tokens sharing all full blocks but the last."""
    shared = random_token_ids(context - BLOCK, rng)
    return [shared + random_token_ids(BLOCK, rng) for _ in range(n)]


def step_input_of(plan: StepPlan) -> StepInput:
    """What the worker would get from the proto, built straight from the plan (the in-process path)."""
    builder = StepBuilder()
    for s in plan.seqs:
        o = s.sampling
        builder.add(
            s.seq_id,
            s.token_ids,
            s.start_pos,
            s.block_table,
            s.slot_mapping,
            sample=s.sample,
            temperature=o.temperature,
            top_p=o.top_p,
            top_k=o.top_k,
            seed=o.seed,
        )
    return builder.build(plan.step_id, list(plan.copies))


class InProcess:
    """A second Worker in this process, on a pool thread as the worker process runs a
    step on a gRPC server thread (on a shared 2-vCPU VM, torch's OpenMP regions
    started from the main thread stall badly under CPU contention)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.thread = ThreadPoolExecutor(1)

    def close(self) -> None:
        self.thread.shutdown()

    def step_ms(self, plan: StepPlan) -> float:
        start = time.perf_counter()
        self.thread.submit(lambda: self.worker.step(step_input_of(plan))).result()
        return ms_since(start)

    def profile(self, plan: StepPlan) -> dict[str, float]:
        """The plan's step under torch.profiler: self CPU time by op group (ms)."""
        from torch.profiler import ProfilerActivity, profile

        def run():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                self.worker.step(step_input_of(plan))
            return prof

        prof = self.thread.submit(run).result()
        groups = {"gather": 0.0, "sdpa": 0.0, "matmul": 0.0, "other": 0.0}
        for event in prof.key_averages():
            ms = event.self_cpu_time_total / 1e3
            if event.key in ("aten::index", "aten::index_select", "aten::copy_"):
                groups["gather"] += ms
            elif "scaled_dot_product" in event.key:
                groups["sdpa"] += ms
            elif event.key in (
                "aten::mm",
                "aten::addmm",
                "aten::bmm",
                "aten::matmul",
                "aten::linear",
                "mkldnn::_linear_pointwise",
            ):  # bf16 weights packed for oneDNN (models/linear.py)
                groups["matmul"] += ms
            else:
                groups["other"] += ms
        return groups


def measured_step(driver: StepDriver, inproc: InProcess, inproc_first: bool) -> dict:
    """One step through the RPC path, piece by piece, and the same step in process,
    before or after the RPC (who goes first flips every step)."""
    plan = driver.schedule()
    inproc_ms = inproc.step_ms(plan) if inproc_first else 0.0
    step = driver.execute(plan)
    if not inproc_first:
        inproc_ms = inproc.step_ms(plan)
    t = step.t | driver.worker_costs(step)
    t["inproc"] = inproc_ms
    t["bytes"] = len(step.payload)
    t["seqs"], t["tokens"] = len(plan.seqs), plan.num_tokens
    return t


def add_requests(driver: StepDriver, prompts: list[list[int]], first_id: int) -> None:
    sampling = SamplingOptions(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    driver.add([Request(f"r{first_id + i}", first_id + i, ids, sampling) for i, ids in enumerate(prompts)])


def part_a(args, model: Path, bar) -> dict:
    worker = ServiceProcess(
        "worker_svc", ["--model", str(model), "--dtype", args.dtype, "--num-blocks", str(args.num_blocks)]
    )
    inproc = InProcess(Worker(WorkerConfig(model=str(model), dtype=args.dtype, num_blocks=args.num_blocks)))
    results, profiles = {}, {}
    with worker:
        for n in args.seqs:
            prompts = prompts_for(n, args.context, random.Random(n))
            driver = StepDriver(worker.address, max_num_seqs=max(args.seqs), prefix_caching=True, max_waiting=1024)
            try:
                add_requests(driver, prompts[:1], 0)  # computes the shared prefix once
                driver.run_until_decoding(1)
                add_requests(driver, prompts[1:], 1)
                driver.run_until_decoding(n)
                for i in range(args.warmup):
                    measured_step(driver, inproc, inproc_first=bool(i % 2))
                steps = []
                for i in range(args.steps):
                    steps.append(measured_step(driver, inproc, inproc_first=bool(i % 2)))
                    bar.update(1)
                if n in args.profile_seqs:
                    profiles[n] = inproc.profile(driver.schedule())
                    driver.planner.requeue_all()  # the profiled plan is not applied; nothing runs after this
            finally:
                driver.close()
            if any(s["tokens"] != n or s["seqs"] != n for s in steps):
                raise RuntimeError(f"expected pure decode steps of {n} sequences")
            results[n] = steps
    inproc.close()
    return results, profiles


# ---- part B: the real services -------------------------------------------------------
def part_b(args, model: Path, seqs: list[int], bar) -> dict:
    log_args = ["--log-format", "json", "--log-level", "debug"]
    # --max-num-seqs on the worker: the scheduler takes it from its Info.
    worker_args = ["--dtype", args.dtype, "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(max(seqs))]
    results = {}
    with (
        Cluster(model, [*worker_args, *log_args], log_args) as cluster,
        SchedulerClient(cluster.address) as client,
    ):
        max_tokens = args.warmup + args.steps + 2
        for n in seqs:
            prompts = prompts_for(n, args.context, random.Random(n))
            client.generate(prompt_token_ids=prompts[0], max_tokens=1, temperature=0.0, timeout=600)  # cache prefix
            seen = len(log_events(cluster.scheduler.log_path, "step"))
            with ThreadPoolExecutor(n) as pool:
                list(
                    pool.map(
                        lambda ids: client.generate(
                            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=1200
                        ),
                        prompts,
                    )
                )
            steps = log_events(cluster.scheduler.log_path, "step")[seen:]
            worker_steps = {e["step_id"]: e for e in log_events(cluster.workers[0].log_path, "step done")}
            full = []
            for prev, cur in zip(steps, steps[1:]):
                if cur["seqs"] != n or cur["tokens"] != n or prev["tokens"] != n:
                    continue
                if cur["step_id"] not in worker_steps:
                    continue
                period = datetime.fromisoformat(cur["timestamp"]) - datetime.fromisoformat(prev["timestamp"])
                full.append(
                    {
                        "period": period.total_seconds() * 1e3,
                        "worker": worker_steps[cur["step_id"]]["total_ms"],
                        "step_ms": cur["step_ms"],
                    }
                )
            results[n] = full[args.warmup :] or full
            bar.update(1)
    return results


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument(
        "--profile-seqs",
        type=int,
        nargs="*",
        default=[GOAL_SEQS],
        help="profile one extra in-process step (torch.profiler) at these sizes",
    )
    parser.add_argument(
        "--e2e-seqs",
        type=int,
        nargs="*",
        default=None,
        help="sequence counts for part B (default: --seqs; none: skip part B)",
    )
    args = parser.parse_args()
    model = require_model(args.model)
    if args.context % BLOCK or args.context < 2 * BLOCK:
        raise SystemExit(f"--context must be a multiple of {BLOCK}, >= {2 * BLOCK}")
    started, load_before = time.perf_counter(), load_average()
    e2e_seqs = args.seqs if args.e2e_seqs is None else args.e2e_seqs
    with progress(len(args.seqs) * args.steps + len(e2e_seqs), NAME) as bar:
        a, profiles = part_a(args, model, bar)
        b = part_b(args, model, e2e_seqs, bar) if e2e_seqs else {}

    cols = ["plan", "build", "encode", "rpc", "parse_reply", "update"]
    rows_a, shares = [], {}
    for n, steps in a.items():
        med = {k: median([s[k] for s in steps]) for k in steps[0]}
        total = median([sum(s[c] for c in cols) for s in steps])
        execute = med["w_total"]
        rpc_rest = transport_ms(med)
        sched = med["plan"] + med["build"] + med["encode"] + med["parse_reply"] + med["update"]
        overhead = median([sum(s[c] for c in cols) - s["w_total"] for s in steps])
        shares[n] = overhead / total
        rows_a.append(
            [
                n,
                f"{med['bytes'] / 1024:.0f}",
                fmt(med["plan"], 2),
                fmt(med["build"] + med["encode"], 2),
                fmt(med["w_parse"] + med["w_validate"], 2),
                fmt(med["w_forward"]),
                fmt(execute),
                fmt(med["w_reply"], 2),
                fmt(rpc_rest, 2),
                fmt(med["rpc"]),
                fmt(med["parse_reply"] + med["update"], 2),
                fmt(total),
                fmt(sched, 2),
                f"{100 * shares[n]:.1f}%",
                fmt(med["inproc"]),
                f"{total / med['inproc']:.2f}x",
            ]
        )
    table_a = markdown_table(
        [
            "seqs",
            "request KiB",
            "plan ms",
            "to proto + serialize ms",
            "worker parse + validate ms",
            "worker forward ms",
            "worker execute ms",
            "worker reply ms",
            "gRPC transport + server ms",
            "RPC wall ms",
            "parse reply + update ms",
            "step total ms",
            "scheduler-side ms",
            "overhead share",
            "in-process step ms",
            "RPC path / in-process",
        ],
        rows_a,
    )
    rows_b, shares_b = [], {}
    for n, steps in b.items():
        if not steps:
            rows_b.append([n, "no full decode steps found in the logs", "", "", "", ""])
            continue
        period = median([s["period"] for s in steps])
        worker = median([s["worker"] for s in steps])
        share = median([1 - s["worker"] / s["period"] for s in steps])
        shares_b[n] = share
        rows_b.append([n, len(steps), fmt(period), fmt(worker), fmt(period - worker), f"{100 * share:.1f}%"])
    table_b = (
        markdown_table(
            [
                "seqs",
                "decode steps",
                "scheduler step period ms",
                "worker execute ms",
                "everything else ms",
                "overhead share",
            ],
            rows_b,
        )
        if b
        else ""
    )
    goal = []
    if GOAL_SEQS in shares:
        s = shares[GOAL_SEQS]
        goal.append(
            f"* part A (attribution), {GOAL_SEQS} sequences: {100 * s:.1f}% vs goal <= {100 * GOAL_SHARE:.0f}%: "
            + ("met" if s <= GOAL_SHARE else f"**missed** by {100 * (s - GOAL_SHARE):.1f} points")
        )
    if GOAL_SEQS in shares_b:
        s = shares_b[GOAL_SEQS]
        goal.append(
            f"* part B (real services, end to end), {GOAL_SEQS} sequences: {100 * s:.1f}% vs goal <= "
            f"{100 * GOAL_SHARE:.0f}%: "
            + ("met" if s <= GOAL_SHARE else f"**missed** by {100 * (s - GOAL_SHARE):.1f} points")
        )
    rows_p = []
    for n, g in profiles.items():
        total = sum(g.values())
        rows_p.append([n, fmt(total)] + [f"{100 * g[k] / total:.0f}%" for k in ("gather", "sdpa", "matmul", "other")])
    table_p = (
        markdown_table(
            [
                "seqs",
                "profiled CPU ms",
                "aten::index / index_select + aten::copy_ (context gather, layout copies)",
                "SDPA kernel",
                "matmuls (aten::mm, mkldnn linear)",
                "everything else",
            ],
            rows_p,
        )
        if rows_p
        else ""
    )
    tables = (
        f"### A. One decode step, piece by piece (medians of {args.steps} steps)\n\n{table_a}\n\n"
        + (
            f"Where the worker's execute time goes (one in-process step under torch.profiler, self CPU time "
            f"by op):\n\n{table_p}\n\n"
            if table_p
            else ""
        )
        + (f"### B. Real worker + scheduler processes, N concurrent streams\n\n{table_b}\n" if b else "")
    )
    notes = (
        f"Goal (issue 10): scheduler + RPC overhead <= {100 * GOAL_SHARE:.0f}% of step time at {GOAL_SEQS} sequences "
        f"on the default model.\n\n" + "\n".join(goal) + "\n\n"
        f"Default model `{model.name}`, {args.dtype} weights and KV, torch attention backend on CPU; every sequence "
        f"has a {args.context}-token context ({args.context - BLOCK} tokens shared through the prefix cache, "
        f"{BLOCK} its own) and decodes one token per step. Overhead share (A) = (step total - worker execute) / step "
        f"total, where step total = plan + to proto + serialize + RPC wall + parse reply + update; worker execute = "
        f"the worker's prepare + forward + sample. 'worker parse + validate' and 'worker reply' are the worker's proto "
        f"and validation code timed in the bench process on the same bytes; 'gRPC transport + server' is the rest of "
        f"the RPC wall time. 'in-process step' = Worker.step on the same plan in this process, on a pool thread "
        f"like the worker's (plan -> StepInput, validation, execute; no proto, no RPC). (B) period = time between consecutive scheduler step log lines for steps "
        f"that decode all N sequences, so it also covers streaming the tokens to the clients; overhead share = 1 - "
        f"worker execute / period (median over steps); the debug JSON logging costs ~0.1 ms per step. "
        f"1-minute load average {load_before:.1f} before, {load_average():.1f} after (2 cores, shared). Run time "
        f"{time.perf_counter() - started:.0f} s."
    )
    print(tables + "\n" + notes)
    plot(a, b, args)
    print(f"wrote {write_result(NAME, 'Step overhead: planning, serialization, gRPC, worker forward', tables, notes)}")


def plot(a: dict, b: dict, args) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [str(n) for n in a]
    parts = [
        ("plan + update", lambda m: m["plan"] + m["update"]),
        ("proto + serialize + parse", lambda m: m["build"] + m["encode"] + m["parse_reply"]),
        ("RPC minus worker execute", lambda m: m["rpc"] - m["w_total"]),
        ("worker execute", lambda m: m["w_total"]),
    ]
    meds = [{k: median([s[k] for s in steps]) for k in steps[0]} for steps in a.values()]
    totals = [sum(fn(m) for _, fn in parts) for m in meds]
    bottom = [0.0] * len(meds)
    for label, fn in parts:
        shares = [100 * fn(m) / t for m, t in zip(meds, totals)]
        left.bar(names, shares, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, shares)]
    left.axhline(100 * (1 - GOAL_SHARE), color="red", linestyle="--", linewidth=1, label="goal: execute >= 90%")
    left.set_ylim(0, 100)
    left.set_xlabel("sequences in the step (2k-token contexts)")
    left.set_ylabel("% of step time (A)")
    left.set_title("A. decode step, piece by piece")
    left.legend(fontsize=7, loc="lower left")
    xs = range(len(meds))
    right.bar([x - 0.2 for x in xs], totals, 0.4, label="RPC path (A step total)")
    right.bar([x + 0.2 for x in xs], [m["inproc"] for m in meds], 0.4, label="in-process Worker.step")
    if b:
        right.plot(
            [x for x, n in enumerate(a) if b.get(n)],
            [median([s["period"] for s in b[n]]) for n in a if b.get(n)],
            "ko-",
            label="real services: step period (B)",
        )
    right.set_xticks(list(xs), names)
    right.set_yscale("log")
    right.set_xlabel("sequences in the step")
    right.set_ylabel("ms per decode step")
    right.set_title("RPC path vs in-process vs real services")
    right.legend(fontsize=7)
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
