"""--cpu-cores: the CPU cores a worker runs on. Two workers on one small machine
(a prefill and a decode worker, or two unified ones) otherwise share every core,
and the scheduler of the OS moves a decode step's thread onto the core where a
long prefill runs; pinned, each keeps its own core (bench/disaggregation.py pins
both configurations alike). Applied at start-up, before torch starts its threads,
to every thread the process has then; later threads inherit it. The thread plan
(--num-threads 0) then counts these cores."""

from __future__ import annotations

import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


def parse_cores(spec: str) -> set[int]:
    """'0', '0-3,6' -> the core numbers; ValueError naming what is wrong."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"{part.strip()!r} is not a core number or a range like 2-3")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"{part.strip()!r} is an empty range")
        cores.update(range(low, high + 1))
    return cores


def cores_problem(spec: str) -> str | None:
    """Why `spec` cannot be applied here (None: it can)."""
    if not hasattr(os, "sched_setaffinity"):
        return "unset on this OS (no sched_setaffinity)"
    try:
        cores = parse_cores(spec)
    except ValueError as exc:
        return f"a list of cores like 0 or 0-3,6: {exc}"
    allowed = os.sched_getaffinity(0)
    if missing := sorted(cores - allowed):
        return f"cores this process may run on ({','.join(map(str, sorted(allowed)))}); {missing[0]} is not one"
    return None


def pin_to_cores(spec: str) -> set[int]:
    """Run every thread of this process, and those it starts later, on these cores."""
    cores = parse_cores(spec)
    tasks = Path("/proc/self/task")
    for tid in [int(t) for t in os.listdir(tasks)] if tasks.is_dir() else [0]:
        os.sched_setaffinity(tid, cores)
    log.info("pinned to cores", cores=sorted(cores))
    return cores
