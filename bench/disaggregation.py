"""Prefill/decode disaggregation (issue 41): 1 prefill + 1 decode worker against two
unified workers, side by side in one run, and the KV transfer between two workers.

    python -m bench.disaggregation [--long-tokens 1024] [--long-prompts 2] [--streams 32] [--repeats 1]

Serving. For each configuration, two worker processes (one thread each, the first
pinned to core 0 and the second to core 1 with --cpu-cores, so both configurations
get the same CPU and neither worker's steps run on the other's core; --no-pin
leaves them to the OS) and a scheduler; a trial:

1. --streams greedy streams (32-token prompts, EOS ignored) start and decode;
2. once each has 8 tokens, --long-prompts prompts of --long-tokens tokens (random
   ids, the same in every trial) are sent at once (t0), --long-output tokens each;
3. the trial ends when the long prompts are done (t1).

ITL = gap between consecutive tokens of a decoding stream, client-side, that ends in
(t0, t1]. Total tok/s = every token the streams received in (t0, t1] / (t1 - t0).
Unified: the router spreads the streams over both workers and each long prompt is
prefilled (in --chunk-tokens chunks) beside decodes. Disaggregated: every prompt
runs on the prefill worker and its KV moves to the decode worker. The long prompts'
tokens (greedy) must be identical in both.

Transfer. Two workers of the model; the decode one pulls N blocks from the prefill
one (FetchBlocks -> ReadBlocks on this machine; no TLS, so the bytes take the direct
connection of worker_svc/kv_transfer/direct.py) for N in --transfer-blocks,
timed at the caller: GB/s at the largest N, and the per-call and per-block costs
from a least-squares line through (N, time). The split of a call: the stream from
the source (FetchBlocksResponse.read_ms: gather, encode, gRPC, decode), the writes
into the destination's pool (write_ms), and each worker's CPU time (/proc), which a
loaded machine does not inflate as it does wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from bench.harness.load import TimedStream, join_streams, random_token_ids, wait_until
from bench.harness.machine import announce, cpu_seconds, load_average
from bench.harness.results import fmt, markdown_table, median, percentile, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, ServiceProcess, require_model, worker_info
from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.client import SchedulerClient

NAME = "disaggregation"
CONFIGS = {"unified (2 x both)": ("both", "both"), "disaggregated (1P + 1D)": ("prefill", "decode")}
ONE_THREAD = {"PAGEDSERVE_WORKER_NUM_THREADS": "1"}
# A worker pinned to one core of a loaded machine loads its model slowly.
START_S = 600.0


def trial(address: str, streams: list[list[int]], longs: list[list[int]], long_output: int) -> dict:
    with SchedulerClient(address) as client:
        decodes = [TimedStream(client, ids, 4000).start() for ids in streams]  # cancelled at t1
        try:
            wait_until(lambda: all(len(s.times) >= 8 for s in decodes), 600, what="streams to decode", streams=decodes)
            t0 = time.perf_counter()
            arrivals = [TimedStream(client, ids, long_output).start() for ids in longs]
            wait_until(lambda: all(s.done for s in arrivals), 1800, what="the long prompts", streams=arrivals)
            t1 = max(s.finished_at or t0 for s in arrivals)
            stats = client.stats()
        finally:
            for s in decodes:
                s.cancel()
        join_streams(decodes + arrivals)
    received = sum(1 for s in decodes + arrivals for t in s.times if t0 < t <= t1)
    return {
        "itl": [g for s in decodes for g in s.gaps_ms(t0, t1)],
        "before": [g for s in decodes for g in s.gaps_ms(s.times[2], t0)],
        "tok_s": received / (t1 - t0),
        "ttft": [((s.first_token_at or t1) - t0) * 1e3 for s in arrivals],
        "tokens": [s.received for s in arrivals],
        "moved": (stats.kv_transfer_blocks, stats.kv_transfer_bytes, stats.kv_transfer_seconds),
    }


def serving(args: argparse.Namespace, model: Path) -> tuple[dict[str, list[dict]], int]:
    rng = random.Random(0)
    streams = [random_token_ids(32, rng) for _ in range(args.streams)]
    longs = [random_token_ids(args.long_tokens, rng) for _ in range(args.long_prompts)]
    worker = ["--model", str(model), "--dtype", args.dtype, "--num-blocks", str(args.num_blocks)]
    budget = ["--max-num-batched-tokens", str(args.chunk_tokens + args.streams), "--chunk-size", str(args.chunk_tokens)]
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        names = list(CONFIGS)[repeat % 2 :] + list(CONFIGS)[: repeat % 2]  # rotating order
        for name in names:
            procs = [
                ServiceProcess(
                    "worker_svc", [*worker, "--kv-role", role, *_pinned(args, i)], env=ONE_THREAD, timeout_s=START_S
                )
                for i, role in enumerate(CONFIGS[name])
            ]
            with _started(procs):
                addresses = ",".join(p.address for p in procs)
                flags = ["--model", str(model), "--workers", addresses, "--no-prefix-caching", *budget]
                with ServiceProcess("scheduler_svc", flags) as scheduler:
                    trial(scheduler.address, streams[:4], [longs[0][:256]], 2)  # warm-up, not measured
                    results[name].append(trial(scheduler.address, streams, longs, args.long_output))
            print(f"{name}: repeat {repeat + 1} done", flush=True)
    return results, len(longs)


@dataclass(frozen=True)
class Transfer:
    """One FetchBlocks of `blocks` blocks: medians over the repeats."""

    blocks: int
    seconds: float  # at the caller
    stream_ms: float  # the decode worker reading the stream from the source (FetchBlocksResponse.read_ms)
    write_ms: float  # ... and writing the blocks into its pool
    source_cpu_ms: float  # CPU time of each worker process during the call
    dest_cpu_ms: float


def transfer(args: argparse.Namespace, model: Path) -> tuple[list[Transfer], int]:
    """Per size in --transfer-blocks, medians of --transfer-repeats calls; and the bytes per block."""
    worker = ["--model", str(model), "--dtype", args.dtype, "--num-blocks", str(max(args.transfer_blocks))]
    procs = [
        ServiceProcess("worker_svc", [*worker, "--kv-role", role, *_pinned(args, i)], timeout_s=START_S)
        for i, role in enumerate(("prefill", "decode"))
    ]
    with _started(procs):
        src, dst = (worker_info(p.address) for p in procs)
        pids = [p.proc.pid for p in procs if p.proc is not None]
        timings = []
        with grpc.insecure_channel(procs[1].address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for blocks in args.transfer_blocks:
                ids = list(range(blocks))
                request = worker_pb2.FetchBlocksRequest(
                    source=procs[0].address,
                    source_instance_id=src.instance_id,
                    instance_id=dst.instance_id,
                    src_block_ids=ids,
                    dst_block_ids=ids,
                )
                stub.FetchBlocks(request, timeout=300)  # warm (channels, pages)
                runs = []
                for _ in range(args.transfer_repeats):
                    cpu_before = [cpu_seconds(pid) for pid in pids]
                    started = time.perf_counter()
                    reply = stub.FetchBlocks(request, timeout=300)
                    elapsed = time.perf_counter() - started
                    cpu = [(cpu_seconds(pid) - before) * 1e3 for pid, before in zip(pids, cpu_before)]
                    runs.append((elapsed, reply.read_ms, reply.write_ms, *cpu))
                timings.append(Transfer(blocks, *(median([r[i] for r in runs]) for i in range(5))))
    return timings, src.kv_bytes_per_block


def _per_cpu_second(size: int, cpu_ms: float) -> str:
    """GB per CPU-second; '-' under the clock tick (10 ms) /proc counts CPU time in."""
    return f"{size / (cpu_ms / 1e3) / 1e9:.2f}" if cpu_ms > 0 else "-"


def _pinned(args: argparse.Namespace, index: int) -> list[str]:
    """The index-th worker's --cpu-cores: its own core (of two)."""
    return ["--cpu-cores", str(index % 2)] if args.pin else []


@contextlib.contextmanager
def _started(procs: list[ServiceProcess]) -> Iterator[list[ServiceProcess]]:
    with contextlib.ExitStack() as stack:
        for proc in procs:
            stack.enter_context(proc)
        yield procs


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares seconds = a + b * blocks: (a, b)."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-prompts", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=1024, help="the issue's 4k, scaled to this CPU")
    parser.add_argument("--long-output", type=int, default=16)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--transfer-blocks", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--transfer-repeats", type=int, default=3)
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="leave the workers' cores to the OS (no --cpu-cores)"
    )
    args = parser.parse_args()
    model = require_model(args.model)
    started, load_before = time.perf_counter(), load_average()
    timings, block_bytes = transfer(args, model)
    print(f"transfer: {timings}; {block_bytes} bytes per block", flush=True)
    results, _ = serving(args, model)
    print(f"serving: {results}", flush=True)  # the raw figures, whatever becomes of the tables

    summary = {}
    for name, runs in results.items():
        itl = [g for r in runs for g in r["itl"]]
        summary[name] = dict(
            base=percentile([g for r in runs for g in r["before"]], 50),
            p50=percentile(itl, 50),
            p99=percentile(itl, 99),
            tok_s=median([r["tok_s"] for r in runs]),
            ttft=median([t for r in runs for t in r["ttft"]]),
        )
    unified, disagg = (summary[name] for name in CONFIGS)
    tokens = [[r["tokens"] for r in results[name]] for name in CONFIGS]
    identical = tokens[0] == tokens[1]
    rows = [
        [
            name,
            fmt(s["base"]),
            fmt(s["p50"]),
            fmt(s["p99"]),
            fmt(s["tok_s"]),
            fmt(s["ttft"], 0),
        ]
        for name, s in summary.items()
    ]
    rows.append(
        [
            "disaggregated / unified",
            fmt(disagg["base"] / unified["base"], 2),
            fmt(disagg["p50"] / unified["p50"], 2),
            f"**{disagg['p99'] / unified['p99']:.2f}** (target <= 0.6)",
            f"**{disagg['tok_s'] / unified['tok_s']:.2f}** (target >= 0.9)",
            fmt(disagg["ttft"] / unified["ttft"], 2),
        ]
    )
    serving_table = markdown_table(
        [
            "configuration",
            "ITL p50 before the burst (ms)",
            "ITL p50 during (ms)",
            "ITL p99 during (ms)",
            "total tok/s during",
            "long-prompt TTFT median (ms)",
        ],
        rows,
    )
    overhead_s, per_block_s = fit([(t.blocks, t.seconds) for t in timings])
    largest = timings[-1]
    transfer_rows = [
        [
            t.blocks,
            f"{t.blocks * block_bytes / 1e6:.1f}",
            fmt(t.seconds * 1e3, 2),
            f"{t.blocks * block_bytes / t.seconds / 1e9:.2f}",
            fmt(t.stream_ms, 1),
            fmt(t.write_ms, 1),
            fmt(t.source_cpu_ms, 1),
            fmt(t.dest_cpu_ms, 1),
            _per_cpu_second(t.blocks * block_bytes, t.source_cpu_ms + t.dest_cpu_ms),
        ]
        for t in timings
    ]
    transfer_table = markdown_table(
        [
            "blocks",
            "MB",
            "ms (median)",
            "GB/s",
            "stream ms",
            "write ms",
            "source CPU ms",
            "destination CPU ms",
            "GB per CPU-second (both)",
        ],
        transfer_rows,
    )
    moved = [r["moved"] for r in results["disaggregated (1P + 1D)"]]
    body = (
        f"## Serving: {args.streams} decoding streams, {args.long_prompts} prompts of {args.long_tokens} tokens "
        f"arriving\n\n{serving_table}\n\nLong prompts' greedy tokens identical in both configurations: "
        f"**{'yes' if identical else 'NO'}**. Blocks moved per disaggregated trial: "
        f"{', '.join(f'{b} ({by / 1e6:.1f} MB in {s * 1e3:.0f} ms)' for b, by, s in moved)}.\n\n"
        f"## KV transfer between two workers on this machine\n\n{transfer_table}\n\n"
        f"Bytes per block: **{block_bytes:,}** ({model.name}, {args.dtype}, 16 tokens, all layers, K and V). "
        f"Throughput at {largest.blocks} blocks: **{largest.blocks * block_bytes / largest.seconds / 1e9:.2f} GB/s** "
        f"(target >= 1). Fit time = a + b x blocks: per-call overhead a = {overhead_s * 1e3:.2f} ms, "
        f"per block b = {per_block_s * 1e3:.3f} ms ({block_bytes / per_block_s / 1e9:.2f} GB/s marginal)."
    )
    notes = (
        f"Model `{model.name}`, {args.dtype}; every worker one thread "
        f"(PAGEDSERVE_WORKER_NUM_THREADS=1){', pinned to its own core (--cpu-cores 0 and 1)' if args.pin else ''} "
        "so both configurations get the same two cores; prefix caching off; "
        f"step budget {args.chunk_tokens} + {args.streams} tokens, chunks of {args.chunk_tokens}. The issue's 4k-token "
        f"prompts are scaled to {args.long_tokens} for this 2-core CPU. {args.repeats} repeat(s), rotating order. "
        f"ITL is measured at the client (gRPC stream arrival). 1-minute load average {load_before:.1f} before, "
        f"{load_average():.1f} after (2 cores, shared). Run time {time.perf_counter() - started:.0f} s."
    )
    print(body + "\n\n" + notes)
    plot(summary)
    write_result(NAME, "Prefill/decode disaggregation", body, notes)


def plot(summary: dict[str, dict]) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary)
    left.bar(names, [summary[n]["p99"] for n in names])
    left.set_ylabel("decode ITL p99 during the burst (ms)")
    right.bar(names, [summary[n]["tok_s"] for n in names])
    right.set_ylabel("total tok/s during the burst")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
