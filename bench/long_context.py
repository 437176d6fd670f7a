"""Long prompts (issue 5): a prompt of up to 200,000 tokens on the tiny long-context
llama (`llama_long`: 1 layer, 1 KV head, head_dim 16, max_position 262144) served
with --max-model-len 200000, while 8 other streams decode.

    python -m bench.long_context [--prompt-tokens 199936] [--chunks 2048] [--mem-prompt-tokens 32768]
    python -m bench.long_context --chunks 512,2048,8192     # the full sweep at 200k: ~10 minutes here

Per chunk size, a fresh worker + scheduler pair (so the worker's peak RSS is
that configuration's), and one trial:

1. 8 greedy decode streams (16-token prompts) start; once each has 12 tokens,
2. the long prompt (random token ids) is sent (t0) and prefilled chunk by chunk
   (--chunk-size C, step budget C + 8 for the decodes);
3. at its first token (t1) the decode streams are cancelled; once it is the only
   request left, Stats gives the tokens its block table covers and the blocks in
   use: KV held = blocks x Info.kv_bytes_per_block, against the formula
   2 x layers x kv_heads x head_dim x bytes x tokens (goal: equal up to the last
   partial block, i.e. blocks == ceil(tokens / 16));
4. the worker's peak RSS (VmHWM) is read, with its RSS just before t0 as the base.

Decode ITL = gaps between consecutive tokens of the 8 streams that end in (t0, t1].

Two tables: (A) the full prompt at each of --chunks (default 2048 only: on this
2-core CPU one 200k-token prefill takes ~3 minutes, so the full sweep at 200k
does not fit a 20-minute `make bench`; pass --chunks 512,2048,8192 for it). One-shot ("unchunked")
prefill of it is not run: the CPU attention op (kernels/reference.py,
paged_prefill_attention) builds a [query x key] boolean mask and SDPA's working
set over it, ~P^2 bytes and more, i.e. > 40 GB at 200k tokens on a 23 GB
machine; the table says so with the estimate. (B) the sweep over 512, 2048,
8192 and unchunked at --mem-prompt-tokens (32,768), where one-shot prefill fits: peak
memory chunked vs unchunked of the same prompt, and the chunking overhead
(prefill time chunked vs one-shot). Also: a 100-token request under
--max-model-len 200000 holds ceil(100/16) blocks (memory follows tokens, not the
limit).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from bench.harness.load import TimedStream, random_token_ids, wait_until
from bench.harness.machine import announce, load_average, memory_mb, peak_rss_mb, rss_mb
from bench.harness.results import fmt, markdown_table, percentile, progress, pyplot, save_plot, write_result
from bench.harness.services import Cluster, tiny_model, worker_info
from scheduler_svc.client import SchedulerClient

NAME = "long_context"
NUM_DECODES = 8
BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def run(model, args, prompt: list[int], chunk: int | None, check_short: bool = False) -> dict:
    n = len(prompt)
    chunk_size, budget = (n, n + NUM_DECODES) if chunk is None else (chunk, chunk + NUM_DECODES)
    num_blocks = math.ceil(args.max_model_len / 16) + 2048
    worker_args = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--num-blocks", str(num_blocks)]
    scheduler_args = [
        "--max-model-len",
        str(args.max_model_len),
        "--chunk-size",
        str(chunk_size),
        "--max-num-batched-tokens",
        str(budget),
    ]
    rng = random.Random(1)
    out = {}
    with Cluster(model, worker_args, scheduler_args) as cluster, SchedulerClient(cluster.address) as client:
        info = worker_info(cluster.workers[0].address, cluster.worker_metadata)
        pid = cluster.workers[0].proc.pid
        out["info"] = info
        if check_short:
            short = TimedStream(client, random_token_ids(100, rng, low=10, high=500), 1000).start()
            wait_until(lambda: short.first_token_at is not None, 120, what="the 100-token request", streams=[short])
            s = client.stats()
            out["short"] = (s.tokens_in_cache, s.blocks_used)
            short.cancel()
            short.join(30)
            wait_until(lambda: client.stats().running == 0, 60, what="the 100-token request to end")
        decodes = [
            TimedStream(client, random_token_ids(16, rng, low=10, high=500), args.max_model_len // 2).start()
            for _ in range(NUM_DECODES)
        ]
        long = None
        try:
            wait_until(
                lambda: all(len(s.times) >= 12 for s in decodes), 300, what="decode streams to start", streams=decodes
            )
            out["base_rss_mb"] = rss_mb(pid)
            steps_before = client.stats().steps_run
            t0 = time.perf_counter()
            long = TimedStream(client, prompt, 64).start()
            wait_until(
                lambda: long.first_token_at is not None or long.error is not None,
                3600,
                interval_s=0.05,
                what="the long prompt's first token",
                streams=decodes,
            )
            if long.error:
                raise RuntimeError(f"long prompt failed: {long.error}")
            t1 = long.first_token_at
            out["steps"] = client.stats().steps_run - steps_before
        finally:
            for s in decodes:
                s.cancel()
        out["during"] = [g for s in decodes for g in s.gaps_ms(t0, t1 + 0.02)]
        out["prefill_s"] = t1 - t0

        def alone() -> bool:
            if long.done:
                raise RuntimeError("the long request ended before the decode streams did; raise --max-model-len")
            stats = client.stats()
            # Aborted streams free their blocks with the update of the step they were in flight in:
            # wait until only the long request's own tokens are held.
            return stats.running == 1 and stats.waiting == 0 and stats.tokens_in_cache <= n + 64

        wait_until(alone, 120, what="the long prompt to be alone")
        s = client.stats()
        out["tokens"], out["blocks"] = s.tokens_in_cache, s.blocks_used
        long.cancel()
        out["peak_rss_mb"] = peak_rss_mb(pid)
        for stream in decodes + [long]:
            stream.join(30)
    return out


def kv_columns(r: dict, args) -> list:
    info = r["info"]
    held = r["blocks"] * info.kv_bytes_per_block
    formula = 2 * info.num_layers * info.num_kv_heads * info.head_dim * BYTES[args.dtype] * r["tokens"]
    expected_blocks = math.ceil(r["tokens"] / info.block_size)
    ok = "yes" if r["blocks"] == expected_blocks and 0 <= held - formula < info.kv_bytes_per_block else "**NO**"
    return [r["tokens"], r["blocks"], f"{held:,}", f"{formula:,}", f"{held - formula:,}", ok]


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=199_936,
        help="the long prompt (default: 200,000 - 64, so its 64 output tokens fit the limit)",
    )
    parser.add_argument("--max-model-len", type=int, default=200_000)
    parser.add_argument("--chunks", default="2048", help="chunk sizes for the full prompt (512,2048,8192: ~10 min)")
    parser.add_argument(
        "--mem-prompt-tokens",
        type=int,
        default=32_768,
        help="prompt length for the chunked vs unchunked memory comparison (0: skip)",
    )
    parser.add_argument("--mem-chunks", default="512,2048,8192,unchunked")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(BYTES))
    args = parser.parse_args()
    if args.prompt_tokens + 64 > args.max_model_len:
        raise SystemExit("--prompt-tokens + 64 must be <= --max-model-len")
    model = tiny_model("llama_long")
    started, load_before = time.perf_counter(), load_average()
    parse = lambda text: [None if c.strip() == "unchunked" else int(c) for c in text.split(",")]
    label = lambda c: "unchunked" if c is None else str(c)
    chunks = parse(args.chunks)
    mem_chunks = parse(args.mem_chunks) if args.mem_prompt_tokens else []
    rng = random.Random(0)
    prompt = random_token_ids(args.prompt_tokens, rng, low=10, high=500)
    mem_prompt = prompt[: args.mem_prompt_tokens]
    # One-shot prefill of the full prompt: the attention mask alone is P^2 bytes.
    mask_gb = args.prompt_tokens**2 / 1e9
    full_unchunked = None in chunks
    if full_unchunked and mask_gb * 1e3 > 0.5 * memory_mb("MemAvailable"):
        chunks = [c for c in chunks if c is not None]
        full_unchunked = False
    full, small = {}, {}
    with progress(len(chunks) + len(mem_chunks), NAME) as bar:
        # The small comparison first: it is quick, and shows the shape before the long runs.
        for chunk in mem_chunks:
            small[label(chunk)] = run(model, args, mem_prompt, chunk)
            bar.update(1)
        for i, chunk in enumerate(chunks):
            full[label(chunk)] = run(model, args, prompt, chunk, check_short=i == 0)
            bar.update(1)

    headers = [
        "chunk size",
        "prefill s",
        "steps",
        "ITL p50 (ms)",
        "ITL mean (ms)",
        "ITL p99 (ms)",
        "ITL max (ms)",
        "worker RSS before (MB)",
        "worker peak RSS (MB)",
        "peak - before (MB)",
    ]
    kv_headers = [
        "tokens held",
        "blocks held",
        "KV bytes held",
        "formula bytes",
        "held - formula",
        "equal up to last block",
    ]

    def rows_for(results: dict) -> list:
        rows = []
        for name, r in results.items():
            rows.append(
                [
                    name,
                    f"{r['prefill_s']:.1f}",
                    r["steps"],
                    fmt(percentile(r["during"], 50)),
                    fmt(sum(r["during"]) / len(r["during"]) if r["during"] else math.nan),
                    fmt(percentile(r["during"], 99)),
                    fmt(max(r["during"], default=math.nan)),
                    f"{r['base_rss_mb']:.0f}",
                    f"{r['peak_rss_mb']:.0f}",
                    f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f}",
                ]
                + kv_columns(r, args)
            )
        return rows

    full_rows = rows_for(full)
    if not full_unchunked:
        full_rows.append(
            ["unchunked", "not run", "", "", "", "", "", "", f"> {mask_gb:,.1f} GB (est.)", "", "", "", "", "", "", ""]
        )
    table_a = markdown_table(headers + kv_headers, full_rows)
    table_b = markdown_table(headers + kv_headers, rows_for(small)) if small else ""
    first = next(iter(full.values()))
    info = first["info"]
    short_tokens, short_blocks = first.get("short", (0, 0))
    tables = f"### A. {args.prompt_tokens:,}-token prompt, --max-model-len {args.max_model_len:,}\n\n{table_a}\n\n" + (
        f"### B. {args.mem_prompt_tokens:,}-token prompt (the first tokens of the same prompt): chunked vs "
        f"one-shot prefill\n\n{table_b}\n"
        if small
        else ""
    )
    overhead = ""
    if "unchunked" in small:
        one_shot = small["unchunked"]["prefill_s"]
        overhead = "Chunking overhead at {:,} tokens (prefill time / one-shot): {}. ".format(
            args.mem_prompt_tokens,
            ", ".join(f"chunk {k}: {r['prefill_s'] / one_shot:.2f}x" for k, r in small.items() if k != "unchunked"),
        )
        mem_ratio = ", ".join(
            f"chunk {k}: {(r['peak_rss_mb'] - r['base_rss_mb']) / max(1.0, small['unchunked']['peak_rss_mb'] - small['unchunked']['base_rss_mb']):.2f}x"
            for k, r in small.items()
            if k != "unchunked"
        )
        overhead += f"Peak working memory (peak - before) relative to one-shot: {mem_ratio}. "
    notes = (
        f"Model `llama_long` ({info.num_layers} layer, {info.num_kv_heads} KV head, head_dim {info.head_dim}, "
        f"{info.kv_dtype} KV: {info.kv_bytes_per_block} bytes per {info.block_size}-token block), worker and scheduler "
        f"with --max-model-len {args.max_model_len:,}, torch attention on CPU. {NUM_DECODES} decode streams run during "
        f"each prefill; ITL is client-side (gRPC stream arrivals) over the prefill window; a decode-only step of "
        f"this tiny model takes a few ms, so with few big chunks most gaps are short ones and the stalls show in the "
        f"mean, p99 and max; step budget = chunk + {NUM_DECODES}. KV held is read from Stats when the long request is the only one left (its prompt plus the "
        f"tokens generated so far): blocks x bytes per block from Info vs the formula 2 x layers x kv_heads x "
        f"head_dim x bytes x tokens. A 100-token request under --max-model-len {args.max_model_len:,} held "
        f"{short_blocks} blocks for {short_tokens} tokens (ceil({short_tokens}/16) = "
        f"{math.ceil(short_tokens / 16)}): memory follows tokens, not the limit. {overhead}"
        f"Unchunked at {args.prompt_tokens:,} tokens is not run: the reference attention's [query x key] mask alone "
        f"is {mask_gb:,.1f} GB (SDPA's working set over it is larger), against {memory_mb('MemAvailable') / 1024:.0f} GB "
        f"available now. Peak RSS is the worker process's VmHWM (fresh worker per row). 1-minute load average "
        f"{load_before:.1f} before, {load_average():.1f} after (2 cores, shared). Run time "
        f"{time.perf_counter() - started:.0f} s."
    )
    print(tables + "\n" + notes)
    plot(full, small, args)
    print(
        f"wrote {write_result(NAME, 'Long context: 200k-token prompt, chunked prefill, KV memory, decode ITL', tables, notes)}"
    )


def plot(full: dict, small: dict, args) -> None:
    plt = pyplot()
    panels = [(f"{args.prompt_tokens:,}-token prompt", full)] + (
        [(f"{args.mem_prompt_tokens:,}-token prompt", small)] if small else []
    )
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 7), squeeze=False)
    for col, (title, results) in enumerate(panels):
        names = list(results)
        xs = range(len(names))
        top, bottom = axes[0][col], axes[1][col]
        top.bar([x - 0.2 for x in xs], [percentile(r["during"], 50) for r in results.values()], 0.4, label="ITL p50")
        top.bar([x + 0.2 for x in xs], [percentile(r["during"], 99) for r in results.values()], 0.4, label="ITL p99")
        top.set_yscale("log")
        top.set_xticks(list(xs), names)
        top.set_ylabel("decode ITL during prefill (ms)")
        top.set_title(title)
        top.legend(fontsize=8)
        bottom.bar(names, [r["peak_rss_mb"] - r["base_rss_mb"] for r in results.values()], color="tab:purple")
        bottom.set_ylabel("worker peak RSS - before (MB)")
        bottom.set_xlabel("chunk size (tokens)")
        twin = bottom.twinx()
        twin.plot(names, [r["prefill_s"] for r in results.values()], "o-", color="tab:orange")
        twin.set_ylabel("prefill time (s)", color="tab:orange")
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
