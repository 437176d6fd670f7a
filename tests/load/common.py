"""Shared by the load scripts: percentiles, tables, the tiny default model."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence]) -> None:
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    print(f"\n### {title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print(line)
    for row in cells:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
    sys.stdout.flush()


def _fmt(value) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def default_model() -> str:
    from tools.tiny_checkpoints import ensure_checkpoint

    return str(ensure_checkpoint("llama"))


def fail(message: str) -> None:
    print(f"\nFAILED: {message}", file=sys.stderr)
    sys.exit(1)
