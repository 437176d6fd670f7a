"""The 4-prompt routing workload two benchmarks share (bench/routing.py: workers
behind one scheduler; bench/scheduler_routing.py: schedulers behind the gateway):
32 requests over 4 system prompts, sent in a burst or paced, under each policy, on
two workers up for the whole grid; the hit rates against the ideal, as a table."""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from bench.harness.results import markdown_table, spread
from bench.harness.services import ServiceProcess, tiny_model

ARRIVALS = ("burst", "paced")
Case = tuple[str, int, list[int]]  # (request id, system prompt index, prompt ids)
# one_run(args, workers, policy, arrival, seed): one cell of the grid
OneRun = Callable[[argparse.Namespace, list[ServiceProcess], str, str, int], "RoutingRun"]


@dataclass
class RoutingRun:
    """One (policy, arrival, seed); a home is where a request ran: a worker or a scheduler."""

    policy: str
    arrival: str
    seed: int
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    ideal: float
    both: int  # system prompts (of 4) with requests on both homes, so computed twice
    per_home: tuple[int, ...]  # requests per home, the less loaded first
    wall_s: float


def routing_workload(seed: int, system_tokens: int) -> list[Case]:
    """32 cases, 8 for each of 4 system prompts, each with its own question; shuffled."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 700) for _ in range(system_tokens)] for _ in range(4)]
    order = [g for g in range(4) for _ in range(8)]
    rng.shuffle(order)
    return [
        (f"s{seed}-{n}-p{g}", g, systems[g] + [rng.randrange(4, 700) for _ in range(rng.randrange(3, 12))])
        for n, g in enumerate(order)
    ]


def ideal_hit_rate(cases: list[Case], system_tokens: int) -> float:
    """Each system prompt computed once, its 7 other requests hitting all its full blocks."""
    full = system_tokens // 16 * 16  # full blocks of a system prompt (the tails never fill one)
    return 28 * full / sum(len(ids) for _, _, ids in cases)


def prompts_on_both(cases: list[Case], homes: list[object]) -> int:
    """How many system prompts had requests on two homes (homes[i]: where cases[i] ran)."""
    placed = collections.defaultdict(set)
    for (_, g, _), home in zip(cases, homes):
        placed[g].add(home)
    return sum(len(p) == 2 for p in placed.values())


def routing_args(description: str, step_tokens_help: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint directory; default: the tiny llama test checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=48)
    parser.add_argument("--step-tokens", type=int, default=64, help=step_tokens_help)
    parser.add_argument("--gap-ms", type=float, default=20.0, help="paced arrivals: time between two requests")
    args = parser.parse_args()
    if not args.model:
        args.model = str(tiny_model("llama"))
    return args


def run_routing_bench(
    description: str, step_tokens_help: str, policies: Collection[str], one_run: OneRun, policy_header: str, home: str
) -> tuple[argparse.Namespace, str, dict[tuple[str, str], list[RoutingRun]], float]:
    """A routing benchmark's main up to its notes: parse the flags, run the grid, print the
    table. The flags, the table, the runs by (arrival, policy) and the seconds it took."""
    args = routing_args(description, step_tokens_help)
    runs, elapsed = run_routing_grid(args, policies, one_run, home)
    table, by_key = routing_table(runs, policies, policy_header, home)
    print(table)
    return args, table, by_key, elapsed


def run_routing_grid(
    args: argparse.Namespace, policies: Collection[str], one_run: OneRun, home: str
) -> tuple[list[RoutingRun], float]:
    """Two workers up for the whole run; one_run(args, workers, policy, arrival, seed)
    for every seed, arrival and policy. The runs and the seconds they took."""
    worker_args = ["--model", args.model, "--dtype", args.dtype, "--num-blocks", "512"]
    workers = [ServiceProcess("worker_svc", worker_args) for _ in range(2)]
    width = max(map(len, policies))
    runs: list[RoutingRun] = []
    t0 = time.perf_counter()
    try:
        for w in workers:
            w.start()
        for seed in range(args.seeds):
            for arrival in ARRIVALS:
                for policy in policies:
                    run = one_run(args, workers, policy, arrival, seed)
                    runs.append(run)
                    print(
                        f"seed {seed} {arrival:<5} {policy:<{width}} hit rate {run.hit_rate:.3f}  "
                        f"both {home}s {run.both}/4  per {home} {run.per_home}",
                        flush=True,
                    )
    finally:
        for w in workers:
            w.stop()
    return runs, time.perf_counter() - t0


def routing_table(
    runs: list[RoutingRun], policies: Collection[str], policy_header: str, home: str
) -> tuple[str, dict[tuple[str, str], list[RoutingRun]]]:
    """The markdown table, a row per (arrival, policy) over the seeds, and the runs by that key."""
    by_key = collections.defaultdict(list)
    for r in runs:
        by_key[(r.arrival, r.policy)].append(r)
    rows = [
        [
            arrival,
            policy,
            spread([r.hit_rate for r in rs], ".3f"),
            spread([r.ideal for r in rs], ".3f"),
            spread([r.prompt_tokens - r.hit_tokens for r in rs], ".0f"),
            spread([r.both for r in rs], ".1f"),
            ", ".join("/".join(map(str, r.per_home)) for r in rs),
            spread([r.wall_s for r in rs], ".2f"),
        ]
        for arrival in ARRIVALS
        for policy in policies
        for rs in [by_key[(arrival, policy)]]
    ]
    headers = [
        "arrival",
        policy_header,
        "prefix cache hit rate",
        "ideal",
        "prefill tokens computed",
        f"system prompts on both {home}s (of 4)",
        f"requests per {home}, per seed",
        "wall s",
    ]
    return markdown_table(headers, rows), by_key


def mean_by_key(
    by_key: dict[tuple[str, str], list[RoutingRun]], value: Callable[[RoutingRun], float]
) -> dict[tuple[str, str], float]:
    """value's mean over the seeds, per (arrival, policy)."""
    return {k: statistics.mean(value(r) for r in rs) for k, rs in by_key.items()}
