"""Prefix caching with a shared 1,000-token system prompt, cache on vs off: time to
first token (TTFT), throughput, hit rate and KV memory, on the default model.

    python -m bench.prefix_cache [--prefix-tokens 1000] [--repeats 8] [--burst 16] [--burst-repeats 3]

Two clusters run side by side, identical but for the scheduler flag: one with
prefix caching (the default), one with --no-prefix-caching. Every request is
the same 1,000-token system prompt followed by its own 20-40-token question
(random token ids, fixed seed). Each cluster first serves one request, as a
server that has been up a while would, so the system prompt is in the cache
of the one that caches.

* TTFT: one request at a time, alternating between the clusters (which goes
  first flips every pair), 2 output tokens; medians of --repeats pairs.
* Throughput: a burst of --burst concurrent requests, 32 output tokens each;
  output tokens/s over the burst's wall time, median TTFT inside the burst,
  alternating clusters, --burst-repeats bursts each.
* Hit rate: the caching scheduler's Stats (prompt tokens found in the prefix
  index / prompt tokens looked up), over the measured requests only.
* Memory: peak KV blocks in use during a burst (Stats.blocks_used, sampled every
  5 ms) x the worker's bytes per block (Info.kv_bytes_per_block).
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness.load import random_token_ids
from bench.harness.machine import announce, load_average
from bench.harness.results import markdown_table, median, progress, pyplot, save_plot, write_result
from bench.harness.services import DEFAULT_MODEL, Cluster, require_model, worker_info
from scheduler_svc.client import SchedulerClient

NAME = "prefix_cache"
GOAL_TTFT_FRACTION = 0.20


def ttft_ms(client: SchedulerClient, ids: list[int], max_tokens: int = 2) -> tuple[float, float, int]:
    """(time to first token ms, total ms, cached prompt tokens) of one streamed request."""
    start = time.perf_counter()
    first = None
    cached = -1
    for reply in client.stream(
        prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=600
    ):
        if reply.token_ids and first is None:
            first = (time.perf_counter() - start) * 1e3
        if reply.finished:
            cached = reply.usage.cached_prompt_tokens
    if first is None:
        raise RuntimeError("no token")
    return first, (time.perf_counter() - start) * 1e3, cached


def burst(client: SchedulerClient, prompts: list[list[int]], max_tokens: int) -> dict:
    """Concurrent requests; returns tokens/s, median TTFT and the peak of Stats.blocks_used."""
    peak, done = 0, threading.Event()

    def watch():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, client.stats().blocks_used)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: ttft_ms(client, ids, max_tokens), prompts))
    elapsed = time.perf_counter() - start
    done.set()
    watcher.join()
    return {
        "tok_s": len(prompts) * max_tokens / elapsed,
        "ttft": median([r[0] for r in results]),
        "wall_s": elapsed,
        "peak_blocks": peak,
    }


def main() -> None:
    announce(NAME)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=8, help="TTFT pairs")
    parser.add_argument("--burst", type=int, default=16, help="concurrent requests in a throughput burst")
    parser.add_argument("--burst-repeats", type=int, default=3)
    parser.add_argument("--burst-max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--num-blocks", type=int, default=2048)
    args = parser.parse_args()
    require_model(args.model)
    started, load_before = time.perf_counter(), load_average()
    rng = random.Random(0)
    system = random_token_ids(args.prefix_tokens, rng)
    question = lambda: random_token_ids(rng.randint(20, 40), rng)
    worker_args = ["--dtype", args.dtype, "--num-blocks", str(args.num_blocks)]
    model = Path(args.model)
    ttft = {"on": [], "off": []}
    cached_tokens = {"on": [], "off": []}
    bursts = {"on": [], "off": []}
    with (
        Cluster(model, worker_args) as on_cluster,
        Cluster(model, worker_args, ["--no-prefix-caching"]) as off_cluster,
        SchedulerClient(on_cluster.address) as on,
        SchedulerClient(off_cluster.address) as off,
    ):
        clients = {"on": on, "off": off}
        info = worker_info(on_cluster.workers[0].address, on_cluster.worker_metadata)
        for client in clients.values():  # warm-up; caches the system prompt where caching is on
            ttft_ms(client, system + question())
            ttft_ms(client, system + question())
        before = on.stats()
        with progress(args.repeats + args.burst_repeats, NAME) as bar:
            for i in range(args.repeats):
                ids = system + question()
                for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    first, _, cached = ttft_ms(clients[name], ids)
                    ttft[name].append(first)
                    cached_tokens[name].append(cached)
                bar.update(1)
            for i in range(args.burst_repeats):
                prompts = [system + question() for _ in range(args.burst)]
                for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    bursts[name].append(burst(clients[name], prompts, args.burst_max_tokens))
                bar.update(1)
        after = on.stats()
        off_after = off.stats()
    hit_rate = (after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens) / max(
        1, after.prefix_cache_query_tokens - before.prefix_cache_query_tokens
    )
    per_block = info.kv_bytes_per_block
    mib = lambda blocks: blocks * per_block / 2**20

    def agg(name, key, fn=median):
        return fn([b[key] for b in bursts[name]])

    t_on, t_off = median(ttft["on"]), median(ttft["off"])
    fraction = t_on / t_off
    rows = [
        [
            "TTFT, one request at a time (ms)",
            f"{t_on:.1f}",
            f"{t_off:.1f}",
            f"{fraction:.2f}",
            " ".join(f"{v:.0f}" for v in ttft["on"]),
            " ".join(f"{v:.0f}" for v in ttft["off"]),
        ],
        [
            f"burst of {args.burst}: output tok/s",
            f"{agg('on', 'tok_s'):.1f}",
            f"{agg('off', 'tok_s'):.1f}",
            f"{agg('on', 'tok_s') / agg('off', 'tok_s'):.2f}",
            " ".join(f"{b['tok_s']:.0f}" for b in bursts["on"]),
            " ".join(f"{b['tok_s']:.0f}" for b in bursts["off"]),
        ],
        [
            f"burst of {args.burst}: median TTFT (ms)",
            f"{agg('on', 'ttft'):.0f}",
            f"{agg('off', 'ttft'):.0f}",
            f"{agg('on', 'ttft') / agg('off', 'ttft'):.2f}",
            " ".join(f"{b['ttft']:.0f}" for b in bursts["on"]),
            " ".join(f"{b['ttft']:.0f}" for b in bursts["off"]),
        ],
        [
            f"burst of {args.burst}: wall time (s)",
            f"{agg('on', 'wall_s'):.2f}",
            f"{agg('off', 'wall_s'):.2f}",
            f"{agg('on', 'wall_s') / agg('off', 'wall_s'):.2f}",
            "",
            "",
        ],
        [
            f"burst of {args.burst}: peak KV blocks in use",
            agg("on", "peak_blocks", max),
            agg("off", "peak_blocks", max),
            f"{agg('on', 'peak_blocks', max) / agg('off', 'peak_blocks', max):.2f}",
            " ".join(str(b["peak_blocks"]) for b in bursts["on"]),
            " ".join(str(b["peak_blocks"]) for b in bursts["off"]),
        ],
        [
            f"burst of {args.burst}: peak KV MiB",
            f"{mib(agg('on', 'peak_blocks', max)):.1f}",
            f"{mib(agg('off', 'peak_blocks', max)):.1f}",
            "",
            "",
            "",
        ],
        [
            "prompt tokens served from cache (Usage, TTFT requests)",
            f"{median(cached_tokens['on']):.0f}",
            f"{median(cached_tokens['off']):.0f}",
            "",
            "",
            "",
        ],
        [
            "prefix-cache hit rate (Stats, measured requests)",
            f"{100 * hit_rate:.1f}%",
            f"{100 * off_after.prefix_cache_hit_rate:.1f}%",
            "",
            "",
            "",
        ],
        ["cached free blocks at the end (Stats)", after.blocks_cached_free, off_after.blocks_cached_free, "", "", ""],
    ]
    table = markdown_table(["metric", "cache on", "cache off", "on / off", "runs, on", "runs, off"], rows)
    verdict = (
        "met" if fraction <= GOAL_TTFT_FRACTION else f"**missed** by {100 * (fraction - GOAL_TTFT_FRACTION):.1f} points"
    )
    notes = (
        f"Goal (issue 10): with a cached {args.prefix_tokens}-token prefix, TTFT <= {100 * GOAL_TTFT_FRACTION:.0f}% of "
        f"uncached. Measured: **{100 * fraction:.1f}%** ({t_off / t_on:.1f}x faster): {verdict}.\n\n"
        f"Default model `{model.name}`, {args.dtype} weights and KV cache ({per_block} bytes per 16-token block), "
        f"{args.num_blocks} blocks per worker. Prompts: the same {args.prefix_tokens}-token system prompt + a "
        f"20-40-token question (random token ids). Two clusters side by side (scheduler with and without "
        f"--no-prefix-caching), requests alternating between them, order flipped every pair; TTFT over "
        f"{args.repeats} sequential pairs (2 output tokens each), bursts of {args.burst} concurrent requests "
        f"x {args.burst_max_tokens} output tokens, {args.burst_repeats} per cluster. With the cache on, the burst "
        f"shares the system prompt's {args.prefix_tokens // 16} full blocks (ref counts), so its peak KV holds one "
        f"copy of them instead of {args.burst}. 1-minute load average {load_before:.1f} before, {load_average():.1f} "
        f"after (2 cores, shared). Run time {time.perf_counter() - started:.0f} s."
    )
    print(table + "\n\n" + notes)
    plot(ttft, bursts, args, mib)
    print(f"wrote {write_result(NAME, 'Prefix caching: shared system prompt, cache on vs off', table, notes)}")


def plot(ttft, bursts, args, mib) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels, colors = ["cache on", "cache off"], ["tab:green", "tab:gray"]
    panels = [
        (axes[0], [median(ttft["on"]), median(ttft["off"])], "median TTFT (ms)", "TTFT, one request at a time"),
        (
            axes[1],
            [median([b["tok_s"] for b in bursts[k]]) for k in ("on", "off")],
            "output tokens/s",
            f"throughput, burst of {args.burst}",
        ),
        (
            axes[2],
            [mib(max(b["peak_blocks"] for b in bursts[k])) for k in ("on", "off")],
            "peak KV MiB",
            f"KV memory, burst of {args.burst}",
        ),
    ]
    for ax, values, ylabel, title in panels:
        ax.bar(labels, values, color=colors)
        for x, v in enumerate(values):
            ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.1f}", (x, v), ha="center", va="bottom")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    fig.suptitle(f"{args.prefix_tokens}-token shared system prompt")
    save_plot(fig, NAME)


if __name__ == "__main__":
    main()
