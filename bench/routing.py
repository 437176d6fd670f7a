"""Prefix-aware routing vs round-robin (and least-loaded) on the 4-prompt workload:
prefix cache hit rate with two workers behind one scheduler.

    python -m bench.routing [--model DIR] [--seeds 3] [--system-tokens 48] [--step-tokens 64] [--gap-ms 20]

The workload (the scale-out issue's): 32 requests, 8 for each of 4 system
prompts of --system-tokens tokens (3 full KV blocks by default), each followed by
its own 3-11-token question; random token ids, the order shuffled per seed;
8 greedy output tokens each. Two workers (tiny llama, float32, CPU by default)
stay up for the whole run; every (policy, arrival, seed) gets a fresh scheduler
(an empty prefix index) started with `--routing POLICY`.

* burst: all 32 requests are sent at once (one thread each).
* paced: one request every --gap-ms ms.

The scheduler's step budget is --step-tokens (64: about one new prompt per
step, as on a busy server). A request can only hit blocks an earlier step
computed, so requests that share a system prompt and are admitted in the same
step all compute it; that bounds the hit rate of every policy in a burst.

Reported per policy and arrival pattern, mean over seeds (min-max):
* hit rate: the scheduler's Stats.prefix_cache_hit_rate = prompt tokens found in
  a worker's prefix index / prompt tokens looked up, over all 32 requests.
  Ideal: each system prompt computed once, its 7 other requests hit all its
  full blocks (28 x 48 / about 32 x 55 = about 0.76, per seed in the table).
* prefill tokens computed: prompt tokens minus the hits.
* prompts on both workers: how many of the 4 system prompts were computed on
  both workers (from the scheduler's "request finished" log lines).
* requests per worker (admin ListWorkers requests_routed), the less loaded first.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.bench_util import load_average
from bench.common import markdown_table, write_result
from proto import admin_pb2, admin_pb2_grpc
from scheduler_svc.client import SchedulerClient
from svc_common.processes import ServiceProcess

NAME = "routing"
POLICIES = ("prefix", "round-robin", "least-loaded")
ARRIVALS = ("burst", "paced")


@dataclass
class Run:
    policy: str
    arrival: str
    seed: int
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    ideal: float
    both_workers: int
    per_worker: tuple[int, ...]
    wall_s: float


def workload(seed: int, system_tokens: int) -> list[tuple[str, int, list[int]]]:
    """(request id, system prompt index, prompt ids) x 32, shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 700) for _ in range(system_tokens)] for _ in range(4)]
    order = [g for g in range(4) for _ in range(8)]
    rng.shuffle(order)
    return [
        (f"s{seed}-{n}-p{g}", g, systems[g] + [rng.randrange(4, 700) for _ in range(rng.randrange(3, 12))])
        for n, g in enumerate(order)
    ]


def one_run(model: str, workers: list[ServiceProcess], policy: str, arrival: str, seed: int, args) -> Run:
    cases = workload(seed, args.system_tokens)
    sched_args = [
        "--model",
        model,
        "--workers",
        ",".join(w.address for w in workers),
        "--routing",
        policy,
        "--admin-port",
        "0",
        "--log-format",
        "json",
        "--max-num-batched-tokens",
        str(args.step_tokens),
    ]
    with ServiceProcess("scheduler_svc", sched_args) as sched, SchedulerClient(sched.address) as client:

        def send(case):
            rid, _, ids = case
            return client.generate(
                prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True, request_id=rid, timeout=300
            )

        start = time.perf_counter()
        with ThreadPoolExecutor(len(cases)) as pool:
            futures = []
            for case in cases:
                futures.append(pool.submit(send, case))
                if arrival == "paced":
                    time.sleep(args.gap_ms / 1e3)
            results = [f.result() for f in futures]
        wall = time.perf_counter() - start
        deadline = time.monotonic() + 10
        while (stats := client.stats()).blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)
        with grpc.insecure_channel(sched.admin_address) as channel:
            listed = admin_pb2_grpc.AdminStub(channel).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        records = [json.loads(line) for line in sched.log_path.read_text().splitlines() if line.startswith("{")]
    worker_of = {r["request_id"]: r["worker"] for r in records if r.get("event") == "request finished"}
    placed = collections.defaultdict(set)
    for rid, g, _ in cases:
        placed[g].add(worker_of[rid])
    assert all(r.completion_tokens == 8 for r in results), "a request did not complete"
    full = args.system_tokens // 16 * 16  # full blocks of a system prompt (the tails never fill one)
    ideal = 28 * full / sum(len(ids) for _, _, ids in cases)
    return Run(
        policy,
        arrival,
        seed,
        stats.prefix_cache_hit_rate,
        stats.prefix_cache_hit_tokens,
        stats.prompt_tokens_total,
        ideal,
        sum(len(w) == 2 for w in placed.values()),
        tuple(sorted(w.requests_routed for w in listed.workers)),
        wall,
    )


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.mean(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint directory; default: the tiny llama test checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=48)
    parser.add_argument("--step-tokens", type=int, default=64, help="scheduler --max-num-batched-tokens")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="paced arrivals: time between two requests")
    args = parser.parse_args()
    if not args.model:
        from worker_svc.tiny_checkpoints import ensure_checkpoint

        args.model = str(ensure_checkpoint("llama"))
    worker_args = ["--model", args.model, "--dtype", args.dtype, "--num-blocks", "512"]
    workers = [ServiceProcess("worker_svc", worker_args) for _ in range(2)]
    runs: list[Run] = []
    t0 = time.perf_counter()
    try:
        for w in workers:
            w.start()
        for seed in range(args.seeds):
            for arrival in ARRIVALS:
                for policy in POLICIES:
                    run = one_run(args.model, workers, policy, arrival, seed, args)
                    runs.append(run)
                    print(
                        f"seed {seed} {arrival:<5} {policy:<12} hit rate {run.hit_rate:.3f}  "
                        f"both workers {run.both_workers}/4  per worker {run.per_worker}",
                        flush=True,
                    )
    finally:
        for w in workers:
            w.stop()
    elapsed = time.perf_counter() - t0

    rows, by_key = [], collections.defaultdict(list)
    for r in runs:
        by_key[(r.arrival, r.policy)].append(r)
    for arrival in ARRIVALS:
        for policy in POLICIES:
            rs = by_key[(arrival, policy)]
            rows.append(
                [
                    arrival,
                    policy,
                    spread([r.hit_rate for r in rs], ".3f"),
                    spread([r.ideal for r in rs], ".3f"),
                    spread([r.prompt_tokens - r.hit_tokens for r in rs], ".0f"),
                    spread([r.both_workers for r in rs], ".1f"),
                    ", ".join("/".join(map(str, r.per_worker)) for r in rs),
                    spread([r.wall_s for r in rs], ".2f"),
                ]
            )
    table = markdown_table(
        [
            "arrival",
            "routing",
            "prefix cache hit rate",
            "ideal",
            "prefill tokens computed",
            "system prompts on both workers (of 4)",
            "requests per worker, per seed",
            "wall s",
        ],
        rows,
    )
    print(table)
    mean = {k: statistics.mean(r.hit_rate for r in rs) for k, rs in by_key.items()}
    computed = {k: statistics.mean(r.prompt_tokens - r.hit_tokens for r in rs) for k, rs in by_key.items()}
    both = {k: statistics.mean(r.both_workers for r in rs) for k, rs in by_key.items()}
    notes = (
        f"Two workers ({Path(args.model).name}, {args.dtype}, 512 blocks of 16 tokens each), "
        f"{args.seeds} seeds, scheduler step budget {args.step_tokens} tokens, paced gap {args.gap_ms:g} ms, "
        f"system prompts of {args.system_tokens} tokens; {elapsed:.0f} s in all, load average "
        f"{load_average():.1f} at the end (wall times are indicative only: 2 shared cores).\n\n"
        f"Prefix-aware routing vs round-robin, hit rate: burst {mean[('burst', 'prefix')]:.3f} vs "
        f"{mean[('burst', 'round-robin')]:.3f}; paced {mean[('paced', 'prefix')]:.3f} vs "
        f"{mean[('paced', 'round-robin')]:.3f} (least-loaded: {mean[('burst', 'least-loaded')]:.3f}, "
        f"{mean[('paced', 'least-loaded')]:.3f}); prefill tokens computed: burst "
        f"{computed[('burst', 'prefix')]:.0f} vs {computed[('burst', 'round-robin')]:.0f}, paced "
        f"{computed[('paced', 'prefix')]:.0f} vs {computed[('paced', 'round-robin')]:.0f}. "
        f"System prompts computed on both workers (of 4): prefix {both[('burst', 'prefix')]:.1f} / "
        f"{both[('paced', 'prefix')]:.1f}, round-robin {both[('burst', 'round-robin')]:.1f} / "
        f"{both[('paced', 'round-robin')]:.1f}. Prefix routing keeps each system prompt on one worker, so "
        f"it is computed once, plus by those of its requests admitted in the same step as the first "
        f"(burst); round-robin and least-loaded send every prompt to both workers, which both compute "
        f"it. With more workers the gap grows: round-robin computes each prompt on every worker.\n"
    )
    print(f"wrote {write_result(NAME, 'Routing: prefix-aware vs round-robin on the 4-prompt workload', table, notes)}")


if __name__ == "__main__":
    main()
