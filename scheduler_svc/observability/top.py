"""A live terminal view of a scheduler, from its Stats RPC:

    python -m scheduler_svc.observability.top --target 127.0.0.1:50051          # refreshes every second; Ctrl-C quits
    python -m scheduler_svc.observability.top --target 127.0.0.1:50051 --once   # one frame on stdout

The block pool is drawn as a bar: `█` blocks in use, `▒` cached-free (free, but
still a prefix-cache hit until evicted), `░` free; then utilization, internal
fragmentation, prefix-cache hit rate, running/waiting, tokens/s, block
allocation rates and latency percentiles (over the scheduler's recent window;
`chunk` is the time of a step that computed a prefill chunk), speculative
decoding's drafts and acceptance once any were made, and one line per worker
when there are several.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import grpc
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from proto import serving_pb2, serving_pb2_grpc
from svc_common.tls import channel_credentials

BAR_WIDTH = 50
GLYPHS = (("█", "bold magenta"), ("▒", "yellow"), ("░", "green"))  # in use, cached-free, free


def split_cells(counts: list[int], width: int) -> list[int]:
    """Cells per part, summing to `width` (largest remainder); a non-zero part
    gets at least one cell when there is room, so a few cached blocks stay visible."""
    total = sum(counts)
    if total <= 0:
        return [0] * (len(counts) - 1) + [width]
    exact = [c * width / total for c in counts]
    cells = [int(x) for x in exact]
    for i in sorted(range(len(counts)), key=lambda i: exact[i] - cells[i], reverse=True)[: width - sum(cells)]:
        cells[i] += 1
    for i, c in enumerate(counts):
        if c > 0 and cells[i] == 0:
            donor = max(range(len(cells)), key=lambda j: cells[j])
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def pool_bar(used: int, cached: int, free_uncached: int, width: int = BAR_WIDTH) -> Text:
    bar = Text("[")
    for cells, (glyph, style) in zip(split_cells([used, cached, free_uncached], width), GLYPHS):
        bar.append(glyph * cells, style=style)
    bar.append("]")
    return bar


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ms(x: float) -> str:
    if x >= 1000:
        return f"{x / 1e3:.2f} s"
    return f"{x:.0f} ms" if x >= 100 else f"{x:.1f} ms"


def render(stats: serving_pb2.StatsResponse, target: str, now: float | None = None) -> Group:
    s = stats
    clock = time.strftime("%H:%M:%S", time.localtime(now if now is not None else time.time()))
    devices = sorted({w.device for w in s.workers if w.device}) or ["?"]
    model = next((w.model for w in s.workers if w.model), "")
    header = Text.assemble(
        ("pagedserve top", "bold"), f"  {target}  {model}  {s.num_workers} worker(s) on {', '.join(devices)}  {clock}"
    )
    free_uncached = s.blocks_free - s.blocks_cached_free
    pool = Text.assemble(
        "KV blocks ", pool_bar(s.blocks_used, s.blocks_cached_free, free_uncached), f" {s.blocks_total} total"
    )
    legend = Text.assemble(
        ("█", GLYPHS[0][1]),
        f" in use {s.blocks_used}   ",
        ("▒", GLYPHS[1][1]),
        f" cached {s.blocks_cached_free}   ",
        ("░", GLYPHS[2][1]),
        f" free {free_uncached}   ",
        f"pinned {s.blocks_pinned}   {s.kv_bytes_per_token} B/token",
    )
    lines = [
        f"utilization {_pct(s.block_utilization)}   fragmentation {_pct(s.fragmentation)} "
        f"({s.kv_slots_unused}/{s.kv_slots_allocated} slots unused)   "
        f"alloc {s.blocks_allocated_per_s:.1f}/s   freed {s.blocks_freed_per_s:.1f}/s",
        f"prefix    hit rate {_pct(s.prefix_cache_hit_rate)} ({s.prefix_cache_hit_tokens}/"
        f"{s.prefix_cache_query_tokens} tokens)   evictions {s.eviction_events} ({s.evictions} blocks reclaimed)",
        f"requests  running {s.running}   waiting {s.waiting}   finished {s.requests_finished}   "
        f"preemptions {s.preemptions}",
        f"tokens/s  computed {s.tokens_per_s:.1f}   generated {s.generation_tokens_per_s:.1f}   "
        f"per step {s.tokens_per_step_mean:.1f}   steps {s.steps_run}   "
        f"prefill/decode {s.prefill_tokens_total}/{s.decode_tokens_total}",
        f"latency   TTFT p50 {_ms(s.ttft_ms_p50)} p95 {_ms(s.ttft_ms_p95)}   "
        f"ITL p50 {_ms(s.itl_ms_p50)} p95 {_ms(s.itl_ms_p95)}   e2e p50 {_ms(s.e2e_ms_p50)} p95 {_ms(s.e2e_ms_p95)}",
        f"step      p50 {_ms(s.step_ms_p50)} p95 {_ms(s.step_ms_p95)}   forward p50 {_ms(s.forward_ms_p50)} "
        f"p95 {_ms(s.forward_ms_p95)}   chunk p50 {_ms(s.prefill_chunk_ms_p50)} "
        f"p95 {_ms(s.prefill_chunk_ms_p95)}",
    ]
    if s.spec_decode_drafts:  # a scheduler with --speculative-method that has drafted
        lines.append(
            f"spec      drafts {s.spec_decode_drafts}   accepted {s.spec_decode_accepted_tokens}/"
            f"{s.spec_decode_draft_tokens} tokens ({_pct(s.spec_decode_acceptance_rate)})   "
            f"tokens per drafting step {s.spec_decode_mean_accepted_length:.2f}"
        )
    parts: list[Text | Table] = [header, pool, legend, *(Text(line) for line in lines)]
    if len(s.workers) > 1:
        table = Table(box=None, padding=(0, 1), show_edge=False)
        for col in ("worker", "pool", "util", "frag", "hit", "run", "wait", "tok/s", "state"):
            table.add_column(col)
        for w in s.workers:
            table.add_row(
                w.address,
                pool_bar(w.blocks_used, w.blocks_cached_free, w.blocks_free - w.blocks_cached_free, 20),
                _pct(w.utilization),
                _pct(w.fragmentation),
                _pct(w.prefix_cache_hit_rate),
                str(w.running),
                str(w.waiting),
                f"{w.tokens_per_s:.1f}",
                "up" if w.healthy else "DOWN",
            )
        parts.append(table)
    return Group(*parts)


def _channel(target: str, tls_ca: str) -> grpc.Channel:
    credentials = channel_credentials(tls_ca) if tls_ca else None
    return grpc.secure_channel(target, credentials) if credentials else grpc.insecure_channel(target)


def fetch(stub: serving_pb2_grpc.SchedulerStub, api_key: str, timeout_s: float) -> serving_pb2.StatsResponse:
    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    stats: serving_pb2.StatsResponse = stub.Stats(serving_pb2.StatsRequest(), timeout=timeout_s, metadata=metadata)
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Live view of a pagedserve scheduler's block pool and load.")
    parser.add_argument("--target", default="127.0.0.1:50051", help="scheduler HOST:PORT")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0 = until Ctrl-C)")
    parser.add_argument("--timeout", type=float, default=5.0, help="Stats RPC deadline in seconds")
    parser.add_argument("--width", type=int, default=0, help="frame width (0 = the terminal's)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("PAGEDSERVE_API_KEY", ""),
        help="sent as 'authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY)",
    )
    parser.add_argument("--tls-ca", default="", help="PEM CA of the scheduler's certificate: connect with TLS")
    args = parser.parse_args(argv)
    if args.interval <= 0:
        parser.error("--interval must be > 0")
    console = Console(width=args.width or None, highlight=False)
    with _channel(args.target, args.tls_ca) as channel:
        stub = serving_pb2_grpc.SchedulerStub(channel)
        if args.once:
            try:
                console.print(render(fetch(stub, args.api_key, args.timeout), args.target))
            except grpc.RpcError as err:
                console.print(f"{args.target}: {err.code().name}: {err.details()}", style="red", markup=False)
                return 1
            return 0
        refreshes = 0
        with Live(Text(f"connecting to {args.target}..."), console=console, auto_refresh=False) as live:
            try:
                while not args.iterations or refreshes < args.iterations:
                    frame: Group | Text
                    try:
                        frame = render(fetch(stub, args.api_key, args.timeout), args.target)
                    except grpc.RpcError as err:
                        frame = Text(f"{args.target}: {err.code().name}: {err.details()} (retrying)", style="red")
                    live.update(frame, refresh=True)
                    refreshes += 1
                    time.sleep(args.interval)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
