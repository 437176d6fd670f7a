"""Timing on a CUDA GPU, and what GPU it was: for benchmarks that need one (they
import torch; the CPU-only benchmarks never import this module)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def cuda_median_ms(fn: Callable[[], object], reps: int, flush: torch.Tensor) -> float:
    """Median of CUDA-event timings of fn, the L2 cache flushed (`flush`, a buffer
    larger than L2, overwritten) before each; three untimed calls first."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def describe_gpu() -> str:
    """The GPU and the software that drives it, in one line (markdown)."""
    import transformers
    import triton

    return (
        f"GPU: **{torch.cuda.get_device_name()}**; torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {triton.__version__}, transformers {transformers.__version__}"
    )
