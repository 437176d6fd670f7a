"""The gateway over two schedulers (--schedulers): prefix-aware routing (consistent
hashing of the prompt's first tokens with a load bound) vs random, prefix cache
hit rate on bench/routing.py's 4-prompt workload (bench/harness/routing.py).

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

from pathlib import Path

import httpx

from bench.harness import routing as grid
from bench.harness.load import send_all
from bench.harness.machine import announce, load_average
from bench.harness.results import write_result
from bench.harness.services import ServiceProcess, log_events
from scheduler_svc.client import SchedulerClient

NAME = "scheduler_routing"
# label -> the gateway's routing flags
POLICIES = {
    "prefix": ["--scheduler-routing", "prefix"],
    "prefix, slack 0": ["--scheduler-routing", "prefix", "--routing-load-slack", "0"],
    "random": ["--scheduler-routing", "random"],
}


def one_run(args, workers: list[ServiceProcess], policy: str, arrival: str, seed: int) -> grid.RoutingRun:
    cases = grid.routing_workload(seed, args.system_tokens)
    schedulers = [
        ServiceProcess(
            "scheduler_svc",
            ["--model", args.model, "--workers", w.address, "--admin-port", "-1", "--log-format", "json"]
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
            ["--schedulers", ",".join(s.address for s in schedulers), "--model-dir", args.model, *POLICIES[policy]],
        ).start()
        with httpx.Client(base_url=f"http://{gateway.address}", timeout=300) as http:

            def send(case):
                _, _, ids = case
                body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                reply = http.post("/v1/completions", json=body)
                reply.raise_for_status()
                return reply.json()

            replies, wall = send_all(cases, send, arrival, args.gap_ms)
        stats = []
        for s in schedulers:
            with SchedulerClient(s.address) as client:
                stats.append(client.stats())
        # The gateway names a choice's Generate call "<response id>-<index>".
        home = {
            r["request_id"]: i for i, s in enumerate(schedulers) for r in log_events(s.log_path, "request finished")
        }
    finally:
        for p in (gateway, *schedulers):
            if p is not None:
                p.stop()
    assert all(r["usage"]["completion_tokens"] == 8 for r in replies), "a request did not complete"
    hit = sum(st.prefix_cache_hit_tokens for st in stats)
    query = sum(st.prefix_cache_query_tokens for st in stats)
    return grid.RoutingRun(
        policy,
        arrival,
        seed,
        hit / query if query else 0.0,
        hit,
        sum(st.prompt_tokens_total for st in stats),
        grid.ideal_hit_rate(cases, args.system_tokens),
        grid.prompts_on_both(cases, [home[f"{reply['id']}-0"] for reply in replies]),
        tuple(sorted(st.requests_finished for st in stats)),
        wall,
    )


def main() -> None:
    announce(NAME)
    args, table, by_key, elapsed = grid.run_routing_bench(
        __doc__, "schedulers' --max-num-batched-tokens", POLICIES, one_run, "gateway routing", "scheduler"
    )
    mean = grid.mean_by_key(by_key, lambda r: r.hit_rate)
    both = grid.mean_by_key(by_key, lambda r: r.both)
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
