"""Host <-> device KV block copies of the second tier (worker_svc/kv_offload.py's
OffloadPool, issue 41), on a GPU: offloads (device gather, then device -> pinned host
on the side stream, then the scatter into the pool) and onloads (pool gather, then
host -> device into the cache), each timed to the end of its copies, beside a plain
pinned-host <-> device copy of the same bytes (the link's ceiling). The cache is
shaped like Llama-3-8B's in bf16 (32 layers, 8 KV heads of 128, 16-token blocks:
2 MiB of K and V per block). Writes bench/results/kv_offload_copy.md.

    python -m bench.kv_offload_copy [--blocks 1 16 128]

Without CUDA it says so and exits 0, writing nothing (the pool's CPU path is tested in
tests/unit/test_kv_offload_worker.py; its disk-backed figures are in bench/results/kv_tiers.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.harness.results import markdown_table, write_result
from worker_svc.kv_offload import OffloadPool
from worker_svc.step.input import TierCopies

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 8, 128
CACHE_BLOCKS, POOL_BLOCKS = 1024, 1024
REPEATS = 10


def timed_ms(run: Callable[[], object], device: torch.device) -> float:
    """Median wall ms of `run` to the end of its device work, after one warm-up."""
    times = []
    for _ in range(REPEATS + 1):
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def pairs(count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` (tier-1, tier-2) pairs of distinct, scattered block ids."""
    src = rng.choice(CACHE_BLOCKS, count, replace=False)
    dst = rng.choice(POOL_BLOCKS, count, replace=False)
    return np.stack([src, dst], axis=1).astype(np.int64)


def row(pool: OffloadPool, count: int, block_bytes: int, rng: np.random.Generator) -> list[str]:
    """One table row: `count` scattered blocks down and up, and the same bytes copied plainly."""
    moves = pairs(count, rng)
    down, up = TierCopies(offloads=moves), TierCopies(onloads=moves[:, ::-1].copy())
    offload = timed_ms(lambda: (pool.run(down), pool.finish()), pool.device)
    onload = timed_ms(lambda: pool.run(up), pool.device)
    nbytes = count * block_bytes
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=pool.device.type == "cuda")
    device = torch.empty_like(host, device=pool.device)
    d2h = timed_ms(lambda: host.copy_(device, non_blocking=True), pool.device)
    h2d = timed_ms(lambda: device.copy_(host, non_blocking=True), pool.device)
    gbps = [nbytes / ms / 1e6 for ms in (offload, onload, d2h, h2d)]
    return [str(count), f"{nbytes / 2**20:.0f}", f"{offload:.2f}", f"{gbps[0]:.1f}", f"{onload:.2f}"] + [
        f"{gbps[1]:.1f}",
        f"{gbps[2]:.1f}",
        f"{gbps[3]:.1f}",
        f"{gbps[0] / gbps[2]:.2f}x / {gbps[1] / gbps[3]:.2f}x",
    ]


def measure(blocks: list[int], device: torch.device) -> list[list[str]]:
    shape = (LAYERS, CACHE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    cache = tuple(torch.randn(shape, dtype=torch.bfloat16, device=device) for _ in range(2))
    pool = OffloadPool(cache, POOL_BLOCKS)
    block_bytes = sum(t[:, 0].numel() * t.element_size() for t in cache)
    rng = np.random.default_rng(0)
    return [row(pool, count, block_bytes, rng) for count in blocks]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 16, 128])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kv_offload_copy: no CUDA GPU here; nothing measured")
        return 0
    rows = measure(args.blocks, torch.device("cuda"))
    headers = ["blocks", "MiB", "offload ms", "offload GB/s", "onload ms", "onload GB/s"]
    headers += ["pinned D2H GB/s", "pinned H2D GB/s", "of the link (off / on)"]
    table = markdown_table(headers, rows)
    print(table)
    gpu = torch.cuda.get_device_name()
    block_mib = LAYERS * BLOCK * KV_HEADS * HEAD_DIM * 2 * 2 / 2**20
    body = (
        f"GPU: **{gpu}**, torch {torch.__version__}. Block: {block_mib:.0f} MiB (K and V, {LAYERS} layers, bf16).\n\n"
    )
    write_result("kv_offload_copy", f"Host <-> device KV block copies on {gpu}", body + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
