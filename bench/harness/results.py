"""What a benchmark reports: figures formatted and summarised, markdown tables,
bench/results/<name>.md (with the machine, commit, command and date) and
bench/results/<name>.png, and a progress bar for long runs."""

from __future__ import annotations

import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.harness.machine import describe

RESULTS = Path(__file__).resolve().parents[1] / "results"


# ---- figures ------------------------------------------------------------------------
def ms_since(start: float) -> float:
    """Milliseconds since `start` (a time.perf_counter())."""
    return (time.perf_counter() - start) * 1e3


def mean(values: Iterable[float]) -> float:
    """The mean; nan for no values."""
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def spread(values: Sequence[float], spec: str) -> str:
    """The mean and, for several values, (min-max)."""
    if len(values) == 1:
        return format(values[0], spec)
    return f"{format(statistics.mean(values), spec)} ({format(min(values), spec)}-{format(max(values), spec)})"


# ---- tables and files -------------------------------------------------------------------
def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def commit() -> str:
    """The short hash of HEAD (of the tree the benchmark runs from); PAGEDSERVE_COMMIT
    names it where the tree came without its history (a lent GPU machine's copy)."""
    if named := os.environ.get("PAGEDSERVE_COMMIT"):
        return named
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_result(name: str, title: str, body: str, notes: str = "", module: str = "") -> Path:
    """bench/results/<name>.md: the title, the machine, commit, command and date, then `body` and `notes`.
    module: the benchmark's module where the results file is named otherwise (an --out name)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    command = shlex.join([Path(sys.executable).name, "-m", f"bench.{module or name}", *sys.argv[1:]])
    path.write_text(
        f"# {title}\n\nmachine: {describe()}  \ncommit: {commit()}  \ncommand: `{command}`  \n"
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{body}\n\n{notes}\n"
    )
    return path


# ---- plots ------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib.pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig: Any, name: str) -> Path:
    """bench/results/<name>.png, and the figure closed."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr (long runs show they are alive)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True, leave=False)
