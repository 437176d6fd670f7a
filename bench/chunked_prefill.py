"""Chunked prefill: inter-token latency (ITL) of 8 running decode streams while a
burst of long prompts arrives, per chunk size (512, 2048, 8192, unchunked), on
the default model.

    python -m bench.chunked_prefill [--long-prompts 3] [--long-tokens 3000] [--repeats 2]

One worker process; for every (chunk size, repeat) a fresh scheduler process in
front of it (the chunk size is a scheduler flag), the configurations in a
rotating order so that drift on this shared machine spreads over all of them.
A trial:

1. 8 greedy streams (32-token prompts, EOS ignored) start and decode;
2. once each has 12 tokens, the --long-prompts prompts of --long-tokens tokens
   (random ids, the same in every trial) are sent at once (t0), 1 output token each;
3. the trial ends when the last long prompt's first token arrives (t1).

ITL = gap between consecutive tokens of a decode stream, client-side; "during
prefill" counts the gaps that end in (t0, t1], "decode only" those before t0.
The long prompts' TTFT (t0 to their first token) is the prefill side of the
trade. Step budget: --max-num-batched-tokens = chunk + 8 (the 8 decodes), so the
chunk size is what limits a step. "unchunked": --chunk-size 8192 (no prompt is
split; the model's limit is 8192 tokens) and a budget of all long prompts + 8,
so the whole burst is one step. Chunk 8192 differs from it because the burst
(3 x 3,000 tokens) is more than one 8,192-token step. Prefix caching is off.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from bench.harness.load import TimedStream, join_streams, random_token_ids, wait_until
from bench.harness.machine import announce, load_average
from bench.harness.results import fmt, markdown_table, median, percentile, progress, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, ServiceProcess, require_model, worker_info
from scheduler_svc.client import SchedulerClient

NAME = "chunked_prefill"
NUM_DECODES = 8


def scheduler_args(model: Path, worker: str, chunk: int | None, long_total: int, max_len: int) -> list[str]:
    if chunk is None:  # unchunked: no prompt split, the whole burst in one step
        chunk_size, budget = max_len, long_total + NUM_DECODES
    else:
        chunk_size, budget = chunk, chunk + NUM_DECODES
    return [
        "--model",
        str(model),
        "--workers",
        worker,
        "--chunk-size",
        str(chunk_size),
        "--max-num-batched-tokens",
        str(budget),
        "--no-prefix-caching",
    ]


def trial(address: str, decode_prompts: list[list[int]], long_prompts: list[list[int]]) -> dict:
    with SchedulerClient(address) as client:
        decodes = [TimedStream(client, ids, 4000).start() for ids in decode_prompts]
        try:
            wait_until(
                lambda: all(len(s.times) >= 12 for s in decodes), 300, what="decode streams to start", streams=decodes
            )
            steps_before = client.stats().steps_run
            t0 = time.perf_counter()
            longs = [TimedStream(client, ids, 1).start() for ids in long_prompts]
            wait_until(
                lambda: all(s.first_token_at is not None or s.error for s in longs),
                1800,
                what="long prompts' first tokens",
            )
            t1 = max(s.first_token_at for s in longs)
            steps = client.stats().steps_run - steps_before
            time.sleep(0.05)
        finally:
            for s in decodes:
                s.cancel()
        join_streams(decodes + longs)
    during = [g for s in decodes for g in s.gaps_ms(t0, t1 + 0.02)]
    baseline_start = min(s.times[4] for s in decodes)
    before = [g for s in decodes for g in s.gaps_ms(baseline_start, t0)]
    return {
        "during": during,
        "before": before,
        "ttft": [(s.first_token_at - t0) * 1e3 for s in longs],
        "window_s": t1 - t0,
        "steps": steps,
    }


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument(
        "--chunks", default="512,2048,8192,unchunked", help="comma-separated chunk sizes; 'unchunked' for none"
    )
    parser.add_argument("--long-prompts", type=int, default=3)
    parser.add_argument("--long-tokens", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-blocks", type=int, default=2048)
    args = parser.parse_args()
    model = require_model(args.model)
    configs = [None if c.strip() == "unchunked" else int(c) for c in args.chunks.split(",")]
    label = lambda c: "unchunked" if c is None else str(c)
    started, load_before = time.perf_counter(), load_average()
    rng = random.Random(0)
    decode_prompts = [random_token_ids(32, rng) for _ in range(NUM_DECODES)]
    long_prompts = [random_token_ids(args.long_tokens, rng) for _ in range(args.long_prompts)]
    long_total = args.long_prompts * args.long_tokens
    results = {label(c): [] for c in configs}
    worker = ServiceProcess(
        "worker_svc", ["--model", str(model), "--dtype", args.dtype, "--num-blocks", str(args.num_blocks)]
    )
    with worker:
        max_len = worker_info(worker.address).max_model_len
        if args.long_tokens >= max_len:
            raise SystemExit(f"--long-tokens must be < the model's {max_len}")
        # Warm-up (kernels, allocator), not measured.
        with ServiceProcess("scheduler_svc", scheduler_args(model, worker.address, 512, long_total, max_len)) as s:
            trial(s.address, decode_prompts[:2], [long_prompts[0][:600]])
        with progress(len(configs) * args.repeats, NAME) as bar:
            for repeat in range(args.repeats):
                order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
                for chunk in order:
                    with ServiceProcess(
                        "scheduler_svc", scheduler_args(model, worker.address, chunk, long_total, max_len)
                    ) as s:
                        results[label(chunk)].append(trial(s.address, decode_prompts, long_prompts))
                    bar.update(1)

    rows, summary = [], {}
    for chunk in configs:
        name = label(chunk)
        runs = results[name]
        during = [g for r in runs for g in r["during"]]
        before = [g for r in runs for g in r["before"]]
        ttft = [t for r in runs for t in r["ttft"]]
        summary[name] = dict(
            p50=percentile(during, 50),
            p99=percentile(during, 99),
            max=max(during),
            mean=sum(during) / len(during),
            base=percentile(before, 50),
            ttft=median(ttft),
            ttft_max=max(ttft),
        )
        rows.append(
            [
                name,
                fmt(summary[name]["base"]),
                fmt(summary[name]["p50"]),
                fmt(summary[name]["mean"]),
                fmt(summary[name]["p99"]),
                fmt(summary[name]["max"]),
                len(during),
                f"{median([r['steps'] for r in runs]):.0f}",
                fmt(summary[name]["ttft"], 0),
                fmt(summary[name]["ttft_max"], 0),
                " / ".join(f"{percentile(r['during'], 99):.0f}" for r in runs),
            ]
        )
    table = markdown_table(
        [
            "chunk size",
            "ITL p50 decode only (ms)",
            "ITL p50 during prefill (ms)",
            "ITL mean during prefill (ms)",
            "ITL p99 during prefill (ms)",
            "ITL max (ms)",
            "gaps measured",
            "steps (median)",
            "long-prompt TTFT median (ms)",
            "long-prompt TTFT max (ms)",
            "p99 per repeat (ms)",
        ],
        rows,
    )
    notes = (
        f"Default model `{model.name}`, {args.dtype}; {NUM_DECODES} decode streams running while "
        f"{args.long_prompts} prompts of {args.long_tokens} tokens arrive at once; {args.repeats} repeats per "
        f"configuration, rotating order, a fresh scheduler per trial in front of one worker process. Budget per step "
        f"= chunk + {NUM_DECODES}; unchunked = chunk {max_len} (whole prompts) and a budget of {long_total + NUM_DECODES} "
        f"tokens (the whole burst in one step). ITL is measured at the client (gRPC stream arrival), so it includes "
        f"the scheduler, the RPC and streaming; the decode-only column is the same streams before the burst. "
        f"Smaller chunks keep decode ITL near its decode-only value at the cost of a later first token for the long "
        f"prompts (more steps, each re-reading the prompt's cached KV). 1-minute load average {load_before:.1f} "
        f"before, {load_average():.1f} after (2 cores, shared). Run time {time.perf_counter() - started:.0f} s."
    )
    print(table + "\n\n" + notes)
    plot(summary, [label(c) for c in configs], args)
    print(
        f"wrote {write_result(NAME, 'Chunked prefill: decode inter-token latency while long prompts arrive', table, notes)}"
    )


def plot(summary: dict, names: list[str], args) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(names))
    width = 0.27
    left.bar([x - width for x in xs], [summary[n]["base"] for n in names], width, label="p50 decode only")
    left.bar(list(xs), [summary[n]["p50"] for n in names], width, label="p50 during prefill")
    left.bar([x + width for x in xs], [summary[n]["p99"] for n in names], width, label="p99 during prefill")
    left.set_xticks(list(xs), names)
    left.set_xlabel("chunk size (tokens)")
    left.set_ylabel("inter-token latency (ms)")
    left.set_yscale("log")
    left.set_title(f"{NUM_DECODES} decode streams")
    left.legend(fontsize=8)
    right.bar(names, [summary[n]["ttft"] for n in names], color="tab:orange")
    right.set_xlabel("chunk size (tokens)")
    right.set_ylabel("median TTFT of the long prompts (ms)")
    right.set_title(f"{args.long_prompts} x {args.long_tokens}-token prompts arriving together")
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
