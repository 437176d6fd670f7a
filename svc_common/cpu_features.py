"""What this CPU can do fast, and the defaults that follow from it (issue 25 item 3).

Pure functions over /proc/cpuinfo's text, so that every choice is tested on the CPUs
these machines come as (AMD EPYC with AVX-512 BF16, AMD EPYC without AVX-512, Intel
Xeon with AMX) whatever CPU runs the tests. No torch here: the scheduler and the
gateway import svc_common.

* `auto_dtype`: bfloat16 where the CPU multiplies bf16 natively (AVX-512 BF16 or AMX),
  float32 elsewhere. Without those instructions torch converts bf16 to fp32 around
  every matmul, which costs more than the halved weight read saves.
* `thread_plan`: the worker's torch threads where the scheduler and the gateway run
  beside it (`make serve`), per step. A small step (a few decodes) takes every core
  but one, and at least one: a team of OpenMP threads waits for whichever one the
  scheduler, the gateway or another process just took the core from, and those
  services are busiest exactly then (one stream on 2 cores: 21.1 ms ITL with one
  thread, 28.9 with two). A step of at least BUSY_STEP_TOKENS tokens (prefill
  chunks, a large batch of decodes) is compute-bound and long enough to amortize
  that wait, so it takes every core: 32 streams 237 vs 155 tok/s and TTFT p50 5.8
  vs 10.6 s, 16 streams over a shared 1k prefix 163 vs 87 tok/s
  (bench/results/peers_threads.md, side by side, quiet 2-core EPYC).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FP32_DTYPE, BF16_DTYPE = "float32", "bfloat16"


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    cores: int
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """bf16 dot products in hardware: AVX-512 BF16 (vdpbf16ps) or AMX tiles."""
        return any(flag in self.flags for flag in BF16_FLAGS)

    @property
    def isa(self) -> str:
        """The vector extensions that matter to the kernels, for start-up logs and benchmarks."""
        shown = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
        return " ".join(f for f in shown if f in self.flags) or "no AVX2"

    def describe(self) -> str:
        return f"{self.model}, {self.cores} cores, {self.isa}"


def parse_cpuinfo(text: str, cores: int) -> CpuFeatures:
    """The first processor's model name and flags from /proc/cpuinfo's text."""
    model, flags = "unknown CPU", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuFeatures(model=model, cores=cores, flags=flags)


def read_cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuFeatures:
    """This machine's CPU; an unreadable cpuinfo gives no flags (so fp32, the safe choice)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text, cores)


def auto_dtype(features: CpuFeatures) -> str:
    """--dtype auto on the CPU."""
    return BF16_DTYPE if features.native_bf16 else FP32_DTYPE


def resolve_dtype(requested: str, device_type: str, features: CpuFeatures) -> str:
    """The weights/activations dtype for --dtype `requested` on `device_type`: auto is
    bf16 on CUDA (every GPU the worker runs on multiplies bf16 natively) and
    `auto_dtype` on the CPU; any other value is kept as it is."""
    if requested != "auto":
        return requested
    return BF16_DTYPE if device_type == "cuda" else auto_dtype(features)


# A step with at least this many tokens in its forward takes ThreadPlan.busy_threads.
BUSY_STEP_TOKENS = 16


@dataclass(frozen=True)
class ThreadPlan:
    worker_threads: int  # for a step of fewer than BUSY_STEP_TOKENS tokens
    reason: str
    busy_threads: int = 0  # for a larger step; 0 = worker_threads

    def threads_for(self, step_tokens: int) -> int:
        if step_tokens >= BUSY_STEP_TOKENS and self.busy_threads:
            return self.busy_threads
        return self.worker_threads


def thread_plan(cores: int, services_beside: bool = True) -> ThreadPlan:
    """Torch threads for a CPU worker given the cores it may use. services_beside: the
    scheduler and the gateway run on the same cores (`make serve`)."""
    if cores <= 0:
        raise ValueError(f"cores must be positive, got {cores}")
    if not services_beside:
        return ThreadPlan(cores, "the worker has the machine to itself")
    if cores == 1:
        return ThreadPlan(1, "1 core: shared with the scheduler and gateway")
    return ThreadPlan(
        cores - 1,
        f"{cores} cores: one left to the scheduler and gateway, all {cores} for steps of >= {BUSY_STEP_TOKENS} tokens",
        busy_threads=cores,
    )
