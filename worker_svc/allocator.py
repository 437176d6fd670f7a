"""glibc malloc settings for the worker process.

A CPU forward allocates and frees many multi-megabyte activations per step. By
default glibc gives freed memory at the top of the heap back to the kernel
(trim threshold 128 KiB, growing dynamically), so the next step faults the same
pages in again: measured here, a batch-32 decode step of the default model took
131 ms with the defaults and 101 ms with a 1 GiB trim threshold and 64 MiB top
pad (bench/vs_transformers.py profiles the step with the same settings).
The cost is that the worker's RSS stays at its peak instead of shrinking between
steps, which a serving process reaches anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger("worker_svc.allocator")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
TRIM_THRESHOLD_BYTES = 1 << 30
TOP_PAD_BYTES = 64 << 20


def keep_freed_memory() -> bool:
    """Apply the settings; False (and a log line) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("malloc tuning skipped: no glibc mallopt", libc=name)
        return False
    applied = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and mallopt(_M_TOP_PAD, TOP_PAD_BYTES) == 1
    log.debug("malloc tuned", trim_threshold=TRIM_THRESHOLD_BYTES, top_pad=TOP_PAD_BYTES, applied=applied)
    return applied
