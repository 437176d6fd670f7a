"""Scheduler load: N concurrent Generate streams against a worker serving a tiny
model. Per N: wall time, tokens, throughput, time to first token and inter-token
latency (p50/p99, client side), and errors, which must be 0.

    python -m tests.load.scheduler_streams [--streams 1,16,64,256,512] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.client import SchedulerClient
from tests.load.common import default_model, fail, percentile, print_table
from tools.processes import Cluster


@dataclass
class StreamResult:
    ttft_s: float = float("nan")
    gaps_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


async def one_stream(stub, prompt_ids: list[int], max_tokens: int, timeout_s: float) -> StreamResult:
    result, sent = StreamResult(), time.perf_counter()
    last = sent
    request = serving_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    )
    try:
        async for reply in stub.Generate(request, timeout=timeout_s):
            if not reply.token_ids:
                continue  # prefill progress
            now = time.perf_counter()
            if result.tokens == 0:
                result.ttft_s = now - sent
            else:
                result.gaps_s.append(now - last)
            last = now
            result.tokens += len(reply.token_ids)
    except grpc.aio.AioRpcError as err:
        result.error = f"{err.code().name}: {err.details()}"
    if not result.error and result.tokens != max_tokens:
        result.error = f"{result.tokens} tokens instead of {max_tokens}"
    return result


async def run_level(address: str, n: int, args, rng: random.Random) -> list:
    limit = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=limit) as channel:
        stub = serving_pb2_grpc.SchedulerStub(channel)
        prompts = [[rng.randrange(4, 700) for _ in range(args.prompt_tokens)] for _ in range(n)]
        started = time.perf_counter()
        results = await asyncio.gather(*(one_stream(stub, p, args.max_tokens, args.timeout_s) for p in prompts))
        wall = time.perf_counter() - started
    ttfts = [r.ttft_s * 1e3 for r in results if r.tokens]
    gaps = [g * 1e3 for r in results for g in r.gaps_s]
    tokens = sum(r.tokens for r in results)
    errors = [r.error for r in results if r.error]
    if errors:
        print(f"N={n}: {len(errors)} errors, first: {errors[0]}")
    return [
        n,
        wall,
        tokens,
        tokens / wall,
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(gaps, 50),
        percentile(gaps, 99),
        len(errors),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", default="1,16,64,256,512")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--timeout-s", type=float, default=120.0, help="deadline of each stream")
    args = parser.parse_args(argv)
    levels = [int(n) for n in args.streams.split(",")]
    rng = random.Random(0)
    with Cluster(
        args.model or default_model(),
        ["--dtype", args.dtype, "--num-blocks", str(args.num_blocks)],
        ["--max-waiting", str(max(levels))],
    ) as cluster:
        rows = [asyncio.run(run_level(cluster.address, n, args, rng)) for n in levels]
        with SchedulerClient(cluster.address) as client:
            stats = client.stats()
    print_table(
        f"scheduler: N concurrent Generate streams ({args.prompt_tokens} prompt + {args.max_tokens} "
        f"generated tokens each, greedy, 1 worker, {args.dtype}, max_num_seqs 256)",
        ["N", "wall s", "tokens", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "errors"],
        rows,
    )
    print(
        f"\nafter the run: running={stats.running} waiting={stats.waiting} blocks_used={stats.blocks_used} "
        f"steps={stats.steps_run} preemptions={stats.preemptions}"
    )
    if any(row[-1] for row in rows):
        fail("some streams ended with an error")
    if (stats.running, stats.waiting, stats.blocks_used) != (0, 0, 0):
        fail("the scheduler still holds requests or blocks")


if __name__ == "__main__":
    main()
