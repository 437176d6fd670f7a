"""The gateway over two schedulers (--schedulers): prefix-aware routing (consistent
hashing of the prompt's first tokens with a load bound) vs random, prefix cache
hit rate on bench/routing.py's 4-prompt workload.

    python -m bench.scheduler_routing [--model DIR] [--seeds 3] [--system-tokens 48] [--step-tokens 64] [--gap-ms 20]

bench/routing.py measures routing between the workers of one scheduler; this is
the tier above it. Two cells (one worker and its own scheduler each) behind one
gateway; the workers stay up for the whole run, every (policy, arrival, seed)
gets fresh schedulers (empty prefix indexes) and a gateway started with
`--scheduler-routing POLICY`. The 32 requests (8 for each of 4 system prompts of
--system-tokens tokens, each with its own 3-11-token question; token-id prompts,
8 greedy tokens each) go through the gateway's /v1/completions.

* burst: all 32 requests at once (one thread each); paced: one every --gap-ms ms.
* hit rate: prompt tokens found in a scheduler's prefix index / prompt tokens
  looked up, over both schedulers (their Stats). Ideal: each system prompt
  computed once (28 of the 32 requests hit all its full blocks).
* prompts on both schedulers: how many of the 4 system prompts had requests on
  both (from the schedulers' "request finished" log lines), so were computed twice.
* requests per scheduler (their Stats.requests_finished), the less loaded first.

Policies: prefix (the defaults: load factor 1.25, slack 16 requests), prefix
with slack 0 (the factor alone, as in the consistent-hashing-with-bounded-loads
paper), random. With prefix routing each system prompt has one home, unless its
scheduler's requests in flight exceed the bound: the prompt then spills to its
next scheduler, which computes it too. Random routing puts every prompt on both.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.bench_util import load_average
from bench.common import markdown_table, write_result
from bench.routing import ARRIVALS, spread, workload
from scheduler_svc.client import SchedulerClient
from svc_common.processes import ServiceProcess

NAME = "scheduler_routing"
# label -> the gateway's routing flags
POLICIES = {
    "prefix": ["--scheduler-routing", "prefix"],
    "prefix, slack 0": ["--scheduler-routing", "prefix", "--routing-load-slack", "0"],
    "random": ["--scheduler-routing", "random"],
}


@dataclass
class Run:
    policy: str
    arrival: str
    seed: int
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    ideal: float
    both: int
    per_scheduler: tuple[int, ...]
    wall_s: float


def finished_records(scheduler: ServiceProcess) -> list[dict]:
    lines = scheduler.log_path.read_text().splitlines()
    records = (json.loads(line) for line in lines if line.startswith("{"))
    return [r for r in records if r.get("event") == "request finished"]


def one_run(model: str, workers: list[ServiceProcess], policy: str, arrival: str, seed: int, args) -> Run:
    cases = workload(seed, args.system_tokens)
    schedulers = [
        ServiceProcess(
            "scheduler_svc",
            ["--model", model, "--workers", w.address, "--admin-port", "-1", "--log-format", "json"]
            + ["--max-num-batched-tokens", str(args.step_tokens)],
        )
        for w in workers
    ]
    gateway = None
    try:
        for s in schedulers:
            s.start()
        gateway = ServiceProcess(
            "gateway_svc",
            ["--schedulers", ",".join(s.address for s in schedulers), "--model-dir", model, *POLICIES[policy]],
        ).start()
        with httpx.Client(base_url=f"http://{gateway.address}", timeout=300) as http:

            def send(case):
                _, _, ids = case
                body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                reply = http.post("/v1/completions", json=body)
                reply.raise_for_status()
                return reply.json()

            start = time.perf_counter()
            with ThreadPoolExecutor(len(cases)) as pool:
                futures = []
                for case in cases:
                    futures.append(pool.submit(send, case))
                    if arrival == "paced":
                        time.sleep(args.gap_ms / 1e3)
                replies = [f.result() for f in futures]
            wall = time.perf_counter() - start
        stats = []
        for s in schedulers:
            with SchedulerClient(s.address) as client:
                stats.append(client.stats())
        # The gateway names a choice's Generate call "<response id>-<index>".
        home = {r["request_id"]: i for i, s in enumerate(schedulers) for r in finished_records(s)}
    finally:
        for p in (gateway, *schedulers):
            if p is not None:
                p.stop()
    assert all(r["usage"]["completion_tokens"] == 8 for r in replies), "a request did not complete"
    placed = collections.defaultdict(set)
    for (_, g, _), reply in zip(cases, replies):
        placed[g].add(home[f"{reply['id']}-0"])
    full = args.system_tokens // 16 * 16
    hit = sum(st.prefix_cache_hit_tokens for st in stats)
    query = sum(st.prefix_cache_query_tokens for st in stats)
    return Run(
        policy,
        arrival,
        seed,
        hit / query if query else 0.0,
        hit,
        sum(st.prompt_tokens_total for st in stats),
        28 * full / sum(len(ids) for _, _, ids in cases),
        sum(len(p) == 2 for p in placed.values()),
        tuple(sorted(st.requests_finished for st in stats)),
        wall,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="checkpoint directory; default: the tiny llama test checkpoint")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=48)
    parser.add_argument("--step-tokens", type=int, default=64, help="schedulers' --max-num-batched-tokens")
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
                        f"seed {seed} {arrival:<5} {policy:<15} hit rate {run.hit_rate:.3f}  "
                        f"on both {run.both}/4  per scheduler {run.per_scheduler}",
                        flush=True,
                    )
    finally:
        for w in workers:
            w.stop()
    elapsed = time.perf_counter() - t0

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
            ", ".join("/".join(map(str, r.per_scheduler)) for r in rs),
            spread([r.wall_s for r in rs], ".2f"),
        ]
        for arrival in ARRIVALS
        for policy in POLICIES
        for rs in [by_key[(arrival, policy)]]
    ]
    table = markdown_table(
        [
            "arrival",
            "gateway routing",
            "prefix cache hit rate",
            "ideal",
            "prefill tokens computed",
            "system prompts on both schedulers (of 4)",
            "requests per scheduler, per seed",
            "wall s",
        ],
        rows,
    )
    print(table)
    mean = {k: statistics.mean(r.hit_rate for r in rs) for k, rs in by_key.items()}
    both = {k: statistics.mean(r.both for r in rs) for k, rs in by_key.items()}
    notes = (
        f"Two cells, each one worker ({Path(args.model).name}, {args.dtype}, 512 blocks of 16 tokens) and its "
        f"own scheduler (step budget {args.step_tokens} tokens), behind one gateway (`--schedulers`, key: the "
        f"first 32 prompt tokens); {args.seeds} seeds, paced gap {args.gap_ms:g} ms, system prompts "
        f"of {args.system_tokens} tokens; {elapsed:.0f} s in all, load average {load_average():.1f} at the end "
        f"(wall times are indicative only: 2 shared cores).\n\n"
        f"Prefix-aware vs random, hit rate: burst {mean[('burst', 'prefix')]:.3f} vs "
        f"{mean[('burst', 'random')]:.3f}; paced {mean[('paced', 'prefix')]:.3f} vs "
        f"{mean[('paced', 'random')]:.3f} (slack 0: {mean[('burst', 'prefix, slack 0')]:.3f}, "
        f"{mean[('paced', 'prefix, slack 0')]:.3f}). System prompts computed on both schedulers (of 4): prefix "
        f"{both[('burst', 'prefix')]:.1f} (burst) / {both[('paced', 'prefix')]:.1f} (paced), slack 0 "
        f"{both[('burst', 'prefix, slack 0')]:.1f} / {both[('paced', 'prefix, slack 0')]:.1f}, random "
        f"{both[('burst', 'random')]:.1f} / {both[('paced', 'random')]:.1f}.\n"
    )
    title = "Routing over schedulers: the gateway's prefix-aware routing vs random on the 4-prompt workload"
    print(f"wrote {write_result(NAME, title, table, notes)}")


if __name__ == "__main__":
    main()
