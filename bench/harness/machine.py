"""What machine a figure was measured on: the CPU (model, the instruction-set flags
matmul speed depends on, cores), memory, Python, and how busy it was. The CPU
differs from one session to the next, so every benchmark prints this line and
writes it into its results file; figures compare only within one run."""

from __future__ import annotations

import math
import os
import platform
from dataclasses import dataclass

# The flags a matmul's speed depends on, in the order of what they add:
# 256-bit FMA, 512-bit, bf16 dot products, int8 dot products, Intel AMX tiles.
MATMUL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


@dataclass(frozen=True)
class Cpu:
    model: str
    cores: int  # the cores this process may run on
    flags: tuple[str, ...]  # the MATMUL_FLAGS it has

    def describe(self) -> str:
        flags = " ".join(self.flags) or "none of " + "/".join(MATMUL_FLAGS)
        return f"{self.model}, {self.cores} cores, matmul flags: {flags}"


def cpu() -> Cpu:
    """This machine's CPU, from /proc/cpuinfo (elsewhere: what platform knows)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    model = fields.get("model name") or platform.processor() or platform.machine()
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return Cpu(model, cores, tuple(f for f in MATMUL_FLAGS if f in flags))


def memory_mb(key: str = "MemTotal") -> float:
    """A /proc/meminfo figure (MemTotal, MemAvailable) in MiB; nan where there is none."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.nan


def load_average() -> float:
    """The 1-minute load average: the machine is shared, so each result says how busy it was."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def describe() -> str:
    """One line: CPU, memory, Python."""
    return f"{cpu().describe()}, {memory_mb() / 1024:.0f} GiB, Python {platform.python_version()}"


def announce(name: str) -> None:
    """Print what machine the benchmark `name` runs on, before it measures anything."""
    print(f"bench.{name} on {describe()}; load average {load_average():.2f}", flush=True)


# ---- one process's memory (Linux /proc) -------------------------------------------
def _status_kb(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM) since it started."""
    return _status_kb(pid, "VmHWM") / 1024


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process has used so far: a service's own cost,
    which other processes on a shared machine do not inflate as they do wall time."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
