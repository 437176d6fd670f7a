"""Shared by the benchmarks: result files, machine description, median timing."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, table: str, notes: str = "") -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    command = " ".join([Path(sys.executable).name, "-m", f"bench.{name}", *sys.argv[1:]])
    path.write_text(
        f"# {title}\n\nmachine: {machine()}  \ncommit: {commit()}  \ncommand: `{command}`  \n"
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{table}\n\n{notes}\n"
    )
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)
