"""Build (once) and load the C++ CPU kernels in kernels/csrc/ as torch ops.

`load()` compiles the sources in kernels/csrc/ with torch.utils.cpp_extension (g++ and
ninja, one compile job per source and core) into one library in a cache folder, which
registers their ops under torch.ops.pagedserve_cpu. The build is tuned to the CPU it
runs on (-march=native), so the cache key holds the sources, the compile flags, torch's
version and the CPU's model and instruction-set flags: a second start on the same
machine loads the .so in well under a second, another CPU gets its own build (~20-90 s
on 2 cores).

Where it cannot be built (no compiler, no ninja, a failed compile) `load()` returns
False after one warning, and kernels/cpu_ops.py falls back to the reference ops.

    PAGEDSERVE_KERNEL_CACHE   the cache folder (default ~/.cache/pagedserve/kernels)
    PAGEDSERVE_CPU_KERNELS=0  never build nor load them (the reference ops run)
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "linear_cpu.cpp",
    CSRC / "elementwise_cpu.cpp",
    CSRC / "moe_cpu.cpp",
)
# Reassociation lets the dot products reduce with a shuffle tree (strict IEEE order
# reduces 16 lanes one by one); finite-math stays off, NaN and infinities keep meaning.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-std=c++17",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
LDFLAGS = ("-fopenmp",)
NAMESPACE = "pagedserve_cpu"


# torch's build lock (a file in the build folder) outlives a process killed mid-build,
# and every later load would wait on it forever; a build takes ~20-90 s on 2 cores, so
# a lock this old has no live builder.
STALE_LOCK_S = 900


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove build_dir's build lock if it is older than STALE_LOCK_S; whether it did."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    warnings.warn(f"removing a stale kernel build lock ({age:.0f} s old): {lock}", RuntimeWarning, stacklevel=2)
    lock.unlink(missing_ok=True)
    return True


def cache_root() -> Path:
    default = Path.home() / ".cache" / "pagedserve" / "kernels"
    return Path(os.environ.get("PAGEDSERVE_KERNEL_CACHE", default))


def _cpu_identity() -> str:
    """The CPU's model and flags (what -march=native compiles for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in lines if line.split(":", 1)[0].strip() in wanted}))


def build_key() -> str:
    digest = hashlib.sha256()
    files = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))  # the sources and the headers they share
    for part in (*(f.read_bytes() for f in files), " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode()):
        digest.update(part)
    digest.update(_cpu_identity().encode())
    return digest.hexdigest()[:16]


@functools.cache
def load() -> bool:
    """Whether torch.ops.pagedserve_cpu holds the compiled ops (built now if needed)."""
    if os.environ.get("PAGEDSERVE_CPU_KERNELS", "1") == "0":
        return False
    name = f"pagedserve_cpu_{build_key()}"
    build_dir = cache_root() / name
    try:
        from torch.utils import cpp_extension

        build_dir.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(build_dir)
        cpp_extension.load(
            name=name,
            sources=[str(source) for source in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
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

    def fake(query: torch.Tensor, *_args: object) -> torch.Tensor:
        return torch.empty_like(query, memory_format=torch.contiguous_format)

    torch.library.register_fake(f"{NAMESPACE}::paged_attention", fake)


def main() -> int:
    """`python -m kernels.cpu_build` (make setup): build or load them now, say which and how long."""
    import time

    start = time.perf_counter()
    built = load()
    where = cache_root() / f"pagedserve_cpu_{build_key()}"
    if built:
        print(f"[setup] C++ CPU kernels ready in {time.perf_counter() - start:.1f} s ({where})")
    return 0 if built else 1


if __name__ == "__main__":
    raise SystemExit(main())
