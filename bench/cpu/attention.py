"""The CPU paged attention (kernels/cpu_ops.py, C++ reading blocks in place) against
the reference ops (a gather of each sequence's context, then SDPA) and against
torch.compile (Inductor) of the same reference, on the default model's attention
shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), one layer.

Decode at 1 / 16 / 64 sequences of a 1,024-token context, and a 64-token prefill
chunk after a 1,024-token cached prefix (16 sequences: the shared-prefix workload),
in bf16 and fp32 (bf16 and int8 caches for the quantized row). Every variant runs
interleaved with the others, several rounds, median per call.

    python -m bench.cpu.attention            # writes bench/results/cpu_attention.md
    python -m bench.cpu.attention --no-inductor
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kernels import cpu_ops, quant, reference
from worker_svc.attention.prefill_route import fresh_prefill_attention

RESULTS = Path(__file__).resolve().parents[1] / "results"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def cpu_line() -> str:
    model, flags = "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{model}, {os.cpu_count()} cores, {' '.join(isa)}, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def setup(num_seqs: int, context: int, query_len: int, dtype: torch.dtype, cache_dtype: torch.dtype):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = num_seqs * blocks_per_seq + 8
    g = torch.Generator().manual_seed(0)
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    kv_scales = quant.KVScales.zeros(shape, cache_dtype, k_cache.device)
    scales = {} if kv_scales is None else {"scales": kv_scales}
    tokens = num_blocks * BLOCK
    reference.write_kv(
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g),
        k_cache,
        v_cache,
        torch.arange(tokens),
        **scales,
    )
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * blocks_per_seq].view(num_seqs, -1).int()
    ctx = torch.full((num_seqs,), context, dtype=torch.int32)
    cu = torch.arange(0, (num_seqs + 1) * query_len, query_len, dtype=torch.int32)
    query = torch.randn(num_seqs * query_len, HEADS, HEAD_DIM, generator=g).to(dtype)
    return query, k_cache, v_cache, tables, cu, ctx, scales


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median seconds per call. With one torch thread all work runs on this thread and its
    CPU time is measured (unmoved by other sessions on the machine); else wall time."""
    now = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    fn()
    times = []
    for _ in range(rounds):
        start = now()
        fn()
        times.append(now() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-inductor", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is measured)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ops.available():
        raise SystemExit("the C++ kernel could not be built")
    compiled_decode = compiled_prefill = None
    compile_s = float("nan")
    if not args.no_inductor:
        compiled_decode = torch.compile(reference.paged_decode_attention, dynamic=True)
        compiled_prefill = torch.compile(reference.paged_prefill_attention, dynamic=True)
    cases = []
    for dtype, cache_dtype in (
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.int8),
    ):
        for num_seqs in (1, 16, 64):
            cases.append(("decode", num_seqs, 1024, 1, dtype, cache_dtype))
        cases.append(("prefill 64 after 1k", 16, 1024 + 64, 64, dtype, cache_dtype))
        cases.append(("fresh prefill 256", 8, 256, 256, dtype, cache_dtype))
    rows = []
    for kind, num_seqs, context, query_len, dtype, cache_dtype in cases:
        query, k, v, tables, cu, ctx, scales = setup(num_seqs, context, query_len, dtype, cache_dtype)
        if kind == "decode":
            args_ = (query, k, v, tables, ctx, 0.125)
            ref_op, ours_op, comp_op = reference.paged_decode_attention, cpu_ops.paged_decode_attention, compiled_decode
        else:
            args_ = (query, k, v, tables, cu, ctx, 0.125)
            ref_op, ours_op = reference.paged_prefill_attention, cpu_ops.paged_prefill_attention
            comp_op = compiled_prefill
        ref = functools.partial(ref_op, *args_, **scales)
        ours = functools.partial(ours_op, *args_, **scales)
        comp = functools.partial(comp_op, *args_, **scales) if comp_op is not None else None
        diff = (ours().float() - ref().float()).abs().max().item()
        sdpa = None
        if kind.startswith("fresh"):  # the worker's SDPA route over the chunks' own K/V (attention.py)
            own_k = torch.randn(num_seqs * query_len, KV_HEADS, HEAD_DIM).to(dtype)
            own_v = torch.randn(num_seqs * query_len, KV_HEADS, HEAD_DIM).to(dtype)
            sdpa = functools.partial(fresh_prefill_attention, query, own_k, own_v, (query_len,) * num_seqs, 0.125)
        comp_ms = float("nan")
        if comp is not None:
            start = time.perf_counter()
            comp()
            compile_s = time.perf_counter() - start if compile_s != compile_s else compile_s
        ref_t, ours_t, comp_t, sdpa_t = [], [], [], []
        for _ in range(args.rounds):  # interleaved: the machine's load hits all alike
            ref_t.append(timed(ref, 3))
            ours_t.append(timed(ours, 3))
            if comp is not None:
                comp_t.append(timed(comp, 3))
            if sdpa is not None:
                sdpa_t.append(timed(sdpa, 3))
        sdpa_ms = f"{statistics.median(sdpa_t) * 1e3:.3f}" if sdpa_t else ""
        ref_ms, ours_ms = statistics.median(ref_t) * 1e3, statistics.median(ours_t) * 1e3
        if comp_t:
            comp_ms = statistics.median(comp_t) * 1e3
        kv_bytes = 2 * num_seqs * context * KV_HEADS * HEAD_DIM * cache_dtype.itemsize
        rows.append(
            f"| {kind} | {num_seqs} | {context} | {str(dtype)[6:]}/{str(cache_dtype)[6:]} | {ref_ms:.3f} | "
            f"{comp_ms:.3f} | {ours_ms:.3f} | {ref_ms / ours_ms:.1f}x | {kv_bytes / ours_ms / 1e6:.1f} | {diff:.1e} | "
            f"{sdpa_ms} |"
        )
        print(rows[-1], flush=True)
    load = open("/proc/loadavg").read().split()[:3]
    text = (
        "# CPU paged attention: C++ in-place blocks vs the reference gather (one layer, SmolLM2 shape)\n\n"
        f"CPU: {cpu_line()}  \ntimes: median per call; with 1 thread, the CPU time of the calling thread  \ncommand: `python -m bench.cpu.attention {' '.join(argv or sys.argv[1:])}`  \n"
        f"load average at the end: {' '.join(load)} (machine shared with other sessions)  \n"
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
        "| op | seqs | context | query/cache dtype | reference ms | Inductor(reference) ms | C++ ms | speed-up vs reference | "
        "C++ KV GB/s | max abs diff | SDPA on the chunk's own K/V ms |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\n"
        f"Inductor: `torch.compile(reference op, dynamic=True)`, first call (compile) {compile_s:.1f} s.\n"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_attention.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
