"""Soak: --minutes of mixed traffic against a scheduler and --workers workers
(tiny model, float32, a small pool so eviction and preemption happen): prompts
sharing a few long prefixes, random lengths and sampling, parallel samples,
stop strings, and random client cancellations and deadlines, with --concurrency
streams in flight. Greedy requests with the same prompt must always stream the
same tokens. At the end Stats must show no request and no block held, the
scheduler's idle-time audits must never have failed, and its shutdown audit
(SIGTERM, graceful) must be clean.

    python -m tests.load.soak [--minutes 1] [--concurrency 32] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import grpc

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.client import SchedulerClient
from tests.load.common import default_model, fail, print_table
from tools.processes import Cluster

GREEDY_PROMPTS = 8  # fixed greedy prompts whose outputs are compared across the run
EXPECTED_ENDINGS = {"finished", "cancelled", "deadline"}


@dataclass
class Plan:
    """One request of the mix and how the client will end it."""

    request: serving_pb2.GenerateRequest
    cancel_after: int | None  # messages read before cancelling
    deadline_s: float
    greedy_key: int | None  # index into the fixed greedy prompts


class Traffic:
    def __init__(self, rng: random.Random, n_fraction: float, vocab: int = 700):
        self.rng = rng
        self.n_fraction = n_fraction
        self.prefixes = [[rng.randrange(4, vocab) for _ in range(rng.choice((48, 64, 96)))] for _ in range(4)]
        self.greedy = [
            (rng.choice(self.prefixes) + [rng.randrange(4, vocab) for _ in range(5)], rng.randrange(4, 24))
            for _ in range(GREEDY_PROMPTS)
        ]
        self.vocab = vocab

    def next(self) -> Plan:
        r = self.rng
        if r.random() < 0.25:
            key = r.randrange(GREEDY_PROMPTS)
            ids, max_tokens = self.greedy[key]
            return Plan(
                serving_pb2.GenerateRequest(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0),
                None,
                120.0,
                key,
            )
        suffix = [r.randrange(4, self.vocab) for _ in range(r.randrange(1, 40))]
        ids = (r.choice(self.prefixes) if r.random() < 0.7 else []) + suffix
        request = serving_pb2.GenerateRequest(
            prompt_token_ids=ids,
            max_tokens=r.randrange(1, 64),
            temperature=r.choice((0.0, 0.7, 1.0)),
            top_k=r.choice((0, 0, 20)),
            ignore_eos=r.random() < 0.5,
        )
        if r.random() < 0.3:
            request.seed = r.randrange(2**32)
        if r.random() < self.n_fraction and len(ids) >= 2:  # samples fork after the second-to-last prompt token
            request.n = r.randrange(2, 4)
        if r.random() < 0.1:
            request.stop.append(r.choice(("the", "a", "e", "ing")))
        cancel_after = r.randrange(0, 6) if r.random() < 0.2 else None
        deadline = r.uniform(0.02, 0.3) if r.random() < 0.05 else 120.0
        return Plan(request, cancel_after, deadline, None)


@dataclass
class Tally:
    started: int = 0
    tokens: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    peak_in_flight: int = 0

    def __post_init__(self):
        self.endings: Counter = Counter()
        self.errors: list[str] = []
        self.greedy_first: dict[int, list[int]] = {}


async def run_one(stub, plan: Plan, tally: Tally) -> None:
    call = stub.Generate(plan.request, timeout=plan.deadline_s)
    tokens: list[int] = []
    messages = 0
    try:
        async for reply in call:
            messages += 1
            tokens.extend(reply.token_ids)
            if plan.cancel_after is not None and messages > plan.cancel_after:
                call.cancel()
                tally.endings["cancelled"] += 1
                break
        else:
            tally.endings["finished"] += 1
            _check_greedy(plan, tokens, tally)
    except asyncio.CancelledError:
        tally.endings["cancelled"] += 1
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and plan.deadline_s < 1:
            tally.endings["deadline"] += 1
        else:
            tally.endings[err.code().name] += 1
            tally.errors.append(f"{err.code().name}: {err.details()}")
    tally.tokens += len(tokens)


def _check_greedy(plan: Plan, tokens: list[int], tally: Tally) -> None:
    if plan.greedy_key is None:
        return
    first = tally.greedy_first.setdefault(plan.greedy_key, tokens)
    tally.greedy_checked += 1
    if tokens != first:
        tally.greedy_mismatches += 1


async def drive(address: str, seconds: float, concurrency: int, seed: int, n_fraction: float) -> tuple[Tally, float]:
    traffic, tally = Traffic(random.Random(seed), n_fraction), Tally()
    deadline = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = serving_pb2_grpc.SchedulerStub(channel)
        in_flight: set[asyncio.Task] = set()
        started = time.monotonic()
        while time.monotonic() < deadline:
            while len(in_flight) < concurrency:
                in_flight.add(asyncio.create_task(run_one(stub, traffic.next(), tally)))
                tally.started += 1
            tally.peak_in_flight = max(tally.peak_in_flight, len(in_flight))
            done, in_flight = await asyncio.wait(
                in_flight, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
        await asyncio.wait_for(asyncio.gather(*in_flight), timeout=180)
        return tally, time.monotonic() - started


def wait_idle(client: SchedulerClient, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def shutdown_audit(cluster: Cluster) -> tuple[str, int]:
    """SIGTERM the scheduler (graceful: it audits every pool on the way out)."""
    proc = cluster.scheduler
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(60)
    log = proc.log_path.read_text(errors="replace")
    failures = log.count("engine audit failed")
    for line in log.splitlines():
        if "engine audit failed" in line:
            print(line[:3000])
    return ("clean" if "engine audit clean" in log and not failures else "FAILED"), failures + (code != 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--num-blocks", type=int, default=40, help="per worker: small, to force eviction and preemption"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-fraction", type=float, default=0.1, help="share of requests with n = 2..3 samples")
    args = parser.parse_args(argv)
    worker_args = ["--dtype", "float32", "--num-blocks", str(args.num_blocks)]
    scheduler_args = [
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "512",
        "--chunk-size",
        "64",
        "--health-interval-s",
        "0.5",
    ]
    with Cluster(args.model or default_model(), worker_args, scheduler_args, num_workers=args.workers) as cluster:
        tally, wall = asyncio.run(
            drive(cluster.address, args.minutes * 60, args.concurrency, args.seed, args.n_fraction)
        )
        with SchedulerClient(cluster.address) as client:
            stats = wait_idle(client)
        audit, audit_failures = shutdown_audit(cluster)
    report(args, tally, wall, stats, audit)
    unexpected = {k: v for k, v in tally.endings.items() if k not in EXPECTED_ENDINGS}
    if unexpected:
        fail(f"unexpected endings {unexpected}; first: {tally.errors[:3]}")
    if tally.greedy_mismatches:
        fail(f"{tally.greedy_mismatches} greedy streams differed from the first run of their prompt")
    if (stats.running, stats.waiting, stats.blocks_used) != (0, 0, 0):
        fail(f"blocks or requests still held: {stats}")
    if audit_failures:
        fail("the engine audit failed (see the scheduler log)")


def report(args, tally: Tally, wall: float, stats, audit: str) -> None:
    e = tally.endings
    print_table(
        f"soak: {args.minutes:g} min, {args.workers} workers x {args.num_blocks} blocks, "
        f"{args.concurrency} streams in flight",
        [
            "requests",
            "finished",
            "cancelled",
            "deadline",
            "errors",
            "tokens",
            "req/s",
            "tok/s",
            "greedy checked",
            "greedy mismatches",
        ],
        [
            [
                tally.started,
                e["finished"],
                e["cancelled"],
                e["deadline"],
                sum(v for k, v in e.items() if k not in EXPECTED_ENDINGS),
                tally.tokens,
                tally.started / wall,
                tally.tokens / wall,
                tally.greedy_checked,
                tally.greedy_mismatches,
            ]
        ],
    )
    print_table(
        "soak: scheduler at the end (idle)",
        [
            "running",
            "waiting",
            "blocks used",
            "blocks total",
            "preemptions",
            "evictions",
            "prefix hit rate",
            "steps",
            "audit",
        ],
        [
            [
                stats.running,
                stats.waiting,
                stats.blocks_used,
                stats.blocks_total,
                stats.preemptions,
                stats.evictions,
                stats.prefix_cache_hit_rate,
                stats.steps_run,
                audit,
            ]
        ],
    )


if __name__ == "__main__":
    main()
