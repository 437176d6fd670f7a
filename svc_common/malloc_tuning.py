"""glibc malloc settings, applied once at a service's start (mallopt through ctypes).

Each service picks the policy its allocations want: the worker keeps freed
activations mapped (worker_svc/allocator.py); the gateway gives large request
bodies back to the kernel (`return_large_blocks`).
"""

from __future__ import annotations

import ctypes
import ctypes.util

import structlog

log = structlog.get_logger("svc_common.malloc_tuning")

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
# Above this, the gateway's buffers come from mmap. 128 KiB is glibc's own starting
# threshold; fixing it stops glibc from raising it (to 32 MiB) after the first freed
# body, which is what put later bodies in the heap.
GATEWAY_MMAP_THRESHOLD_BYTES = 128 << 10


def apply(settings: dict[int, int], purpose: str) -> bool:
    """mallopt(option, value) for each item; False (and a log line) where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        log.info("malloc tuning skipped: no glibc mallopt", libc=name, purpose=purpose)
        return False
    applied = all(mallopt(option, value) == 1 for option, value in settings.items())
    log.debug("malloc tuned", purpose=purpose, settings=settings, applied=applied)
    return applied


def return_large_blocks() -> bool:
    """The gateway's policy. It holds request bodies of up to --max-request-bytes, many at
    once, for a moment each. With glibc's adaptive threshold the first freed body moves
    the mmap threshold above the body's size, later bodies land in the heap, and what the
    heap keeps after a burst depends on how their frees interleave: three waves of 20
    stalled 2 MB bodies left the gateway 3 to 34 MB larger than one wave did (uvloop, on a
    quiet machine), and 44 MB in a loaded CI run. Fixed, every large body is its own
    mapping and goes back to the kernel the moment it is freed."""
    return apply({M_MMAP_THRESHOLD: GATEWAY_MMAP_THRESHOLD_BYTES}, "gateway: large blocks returned")
