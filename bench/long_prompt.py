"""One long prompt must not stall the others (issue 35, item 5): with a stream
decoding, a 4,000-token prompt arrives, then a 5-token request right behind it.
Measured per configuration, side by side in one run on one worker process:

* the running stream's largest inter-token gap while the long prompt is prefilled;
* the short request's TTFT (it arrives --short-after-s after the long prompt);
* the long prompt's own TTFT (what chunking costs it).

    python -m bench.long_prompt [--long-tokens 4000] [--repeats 1]

Configurations (a fresh scheduler each, the order rotating per repeat):
"fixed" = the flags' budget as given on every device (--step-target-ms 0: one
8,192-token step and chunk, the behaviour before issue 35); "sized" = the defaults
now: a CPU worker's budget sized from its measured speed to --step-target-ms
(1,000 ms), one request's chunk at most half of it. Target on the 2-core CPU with
SmolLM2-135M: largest gap <= 2 s, short TTFT <= 3 s.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench.harness.load import TimedStream, random_token_ids, wait_until
from bench.harness.machine import announce, load_average
from bench.harness.results import fmt, markdown_table, median, write_result
from bench.harness.services import DEFAULT_MODEL, ServiceProcess, require_model
from scheduler_svc.client import SchedulerClient

NAME = "long_prompt"
CONFIGS = {"fixed": ["--step-target-ms", "0"], "sized": []}


def trial(address: str, running: list[int], long: list[int], short: list[int], short_after_s: float) -> dict:
    with SchedulerClient(address) as client:
        stream = TimedStream(client, running, 4000).start()
        try:
            wait_until(lambda: len(stream.times) >= 8, 120, what="the running stream", streams=[stream])
            t0 = time.perf_counter()
            big = TimedStream(client, long, 1).start()
            time.sleep(short_after_s)
            small = TimedStream(client, short, 1).start()
            wait_until(
                lambda: big.first_token_at is not None and small.first_token_at is not None,
                900,
                what="both first tokens",
                streams=[big, small],
            )
            end = max(big.first_token_at or 0.0, small.first_token_at or 0.0)
            wait_until(lambda: len(stream.times) >= 2 and stream.times[-1] > end, 60, what="a token after")
        finally:
            stream.cancel()
        for s in (stream, big, small):
            s.join(30)
            if s.error:
                raise RuntimeError(f"stream failed: {s.error}")
    gaps = stream.gaps_ms(t0, stream.times[-1])
    return {
        "max_gap_ms": max(gaps),
        "short_ttft_ms": ((small.first_token_at or 0.0) - small.started_at) * 1e3,
        "long_ttft_ms": ((big.first_token_at or 0.0) - t0) * 1e3,
    }


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--short-after-s", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", default="fixed,sized")
    parser.add_argument("--step-target-ms", type=float, default=None, help="sized: this target (default: the flag's)")
    args = parser.parse_args()
    model = require_model(args.model)
    names = args.configs.split(",")
    rng = random.Random(0)
    running, short = random_token_ids(32, rng), random_token_ids(5, rng)
    longs = [random_token_ids(args.long_tokens, rng) for _ in range(args.repeats * len(names) + 1)]
    started, load_before = time.perf_counter(), load_average()
    results: dict[str, list[dict]] = {n: [] for n in names}
    with ServiceProcess("worker_svc", ["--model", str(model), "--num-blocks", "1024"]) as worker:
        base = ["--model", str(model), "--workers", worker.address, "--no-prefix-caching"]
        with ServiceProcess("scheduler_svc", base) as s:  # warm-up (kernels, allocator), not measured
            trial(s.address, running, longs[-1][:300], short, 0.1)
        for repeat in range(args.repeats):
            for i, name in enumerate(names[repeat % len(names) :] + names[: repeat % len(names)]):
                target = (
                    ["--step-target-ms", str(args.step_target_ms)] if name == "sized" and args.step_target_ms else []
                )
                with ServiceProcess("scheduler_svc", base + CONFIGS[name] + target) as s:
                    long = longs[repeat * len(names) + i]  # a fresh prompt: nothing cached anywhere
                    results[name].append(trial(s.address, running, long, short, args.short_after_s))
                print(name, results[name][-1], flush=True)
    rows = [
        [
            name,
            fmt(max(r["max_gap_ms"] for r in runs) / 1e3, 2),
            fmt(max(r["short_ttft_ms"] for r in runs) / 1e3, 2),
            fmt(median([r["long_ttft_ms"] for r in runs]) / 1e3, 1),
            " / ".join(f"{r['max_gap_ms'] / 1e3:.2f}" for r in runs),
        ]
        for name, runs in results.items()
    ]
    table = markdown_table(
        [
            "configuration",
            "running stream's largest gap (s)",
            "short request's TTFT, worst (s)",
            "long prompt's TTFT, median (s)",
            "largest gap per repeat (s)",
        ],
        rows,
    )
    notes = (
        f"Model `{Path(model).name}` (worker defaults), one worker process, a fresh scheduler per trial, prefix "
        f"caching off. A stream decodes (32-token prompt); a {args.long_tokens}-token prompt arrives (1 output token), "
        f"and {args.short_after_s} s later a 5-token request (1 output token). Gaps and TTFTs measured at the client "
        f"(gRPC arrival). {args.repeats} repeat(s) per configuration, rotating order. Target: largest gap <= 2 s, "
        f"short TTFT <= 3 s. 1-minute load average {load_before:.1f} before, {load_average():.1f} after (2 cores, "
        f"shared with other work). Run time {time.perf_counter() - started:.0f} s."
    )
    print(table + "\n\n" + notes)
    write_result(NAME, "A long prompt among running streams: step budget sized from the CPU's speed", table, notes)


if __name__ == "__main__":
    main()
