"""Build (once per machine) and load the C++ CPU kernels in kernels/csrc/ as torch ops.

`load()` compiles the sources in kernels/csrc/ into one library in the shared kernel
cache (kernels/build_cache.py: keyed by everything that changes the binary, built in
a private folder and renamed into place, one builder at a time), which registers
their ops under torch.ops.pagedserve_cpu. The build is tuned to the CPU it runs on
(-march=native, or PAGEDSERVE_CPU_MARCH): a second start, from this checkout or any other with the same
sources, compiler, torch and CPU, loads the .so in well under a second; a cold
build takes ~1-2 min on 2 cores.

Where it cannot be built (no compiler, no ninja, a failed compile) `load()` returns
False after one warning, and kernels/cpu_ops.py falls back to the reference ops.

    python -m kernels.cpu_build   build now (make setup, and the launchers before any
                                  worker starts), a line per compile unit
    PAGEDSERVE_CPU_KERNELS=0      never build nor load them (the reference ops run)
    PAGEDSERVE_CPU_MARCH=haswell  build for that -march instead of this CPU's own (a fleet's
                                  oldest CPU; an AVX2-only build measured on a later one)
    PAGEDSERVE_WORK_POOL=0        the weight-streaming kernels never share their rows
                                  with helper threads (csrc/work_pool.h; for measuring)
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path

import structlog

from kernels.build_cache import Library

log = structlog.get_logger("kernels.cpu_build")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "linear_cpu.cpp",
    CSRC / "elementwise_cpu.cpp",
    CSRC / "quant_linear_cpu.cpp",
    CSRC / "quant_int8_cpu.cpp",
    CSRC / "moe_cpu.cpp",
    CSRC / "lora_cpu.cpp",
    CSRC / "wquant_cpu.cpp",
    CSRC / "decoder_loop_cpu.cpp",
    CSRC / "work_pool.cpp",
    CSRC / "weight_prefetch.cpp",
    CSRC / "sampling_cpu.cpp",
)
# Reassociation lets the dot products reduce with a shuffle tree (strict IEEE order
# reduces 16 lanes one by one); finite-math stays off, NaN and infinities keep meaning.
CFLAGS = (
    "-O3",
    f"-march={os.environ.get('PAGEDSERVE_CPU_MARCH', 'native')}",
    "-fopenmp",
    "-std=c++17",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
LDFLAGS = ("-fopenmp",)
NAMESPACE = "pagedserve_cpu"
LIBRARY = Library(NAMESPACE, SOURCES, tuple(sorted(CSRC.glob("*.h"))), CFLAGS, LDFLAGS)


def enabled() -> bool:
    return os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") != "0"


@functools.cache
def load() -> bool:
    """Whether torch.ops.pagedserve_cpu holds the compiled ops (built now if needed)."""
    if not enabled():
        return False
    try:
        LIBRARY.load()
    except Exception as exc:  # no compiler / ninja, or a failed build: the reference still serves
        warnings.warn(
            f"the C++ CPU kernels could not be built ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); "
            "the reference torch ops run instead (slower)",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    _register_fake()
    return True


def _register_fake() -> None:
    """Shapes for torch.compile's tracing: the op returns a tensor like its query."""
    import torch

    def fake(query: torch.Tensor, *_args: object) -> torch.Tensor:
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    torch.library.register_fake(f"{NAMESPACE}::paged_attention", fake)


def main() -> int:
    """`python -m kernels.cpu_build`: build or load them now, say which and how long."""
    from svc_common.log_setup import configure_logging

    configure_logging("console")
    start = time.perf_counter()
    if not enabled():
        log.info("C++ CPU kernels off (PAGEDSERVE_CPU_KERNELS=0)")
        return 0
    cached = LIBRARY.built()
    if not load():
        return 1
    log.info(
        "C++ CPU kernels ready",
        seconds=round(time.perf_counter() - start, 1),
        found="in the cache" if cached else "built now (here, or by the process this one waited for)",
        path=str(LIBRARY.path()),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
