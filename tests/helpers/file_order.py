"""The order `make test` hands test files to its processes: longest first.

pytest-xdist's `--dist loadfile` sends each process the next file as it runs out,
in collection order (with `--no-loadscope-reorder`; by default it orders files by
their number of tests, which put the long integration files, few tests each, last:
one process ran them alone for minutes while the other sat idle). Longest first,
the last files handed out are short and both processes end close together.

The seconds per file are measured (`--record-file-seconds PATH` writes them at the
end of a run) and kept in tests/file_seconds.json; a file not in it is taken as
long and goes first, so a new slow file cannot end up last."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import pytest

TABLE = Path(__file__).resolve().parent.parent / "file_seconds.json"


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load(path: Path = TABLE) -> dict[str, float]:
    return json.loads(path.read_text()) if path.exists() else {}


def longest_first(items: Sequence[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """Files by their seconds, longest first (unknown files before all); a file's
    tests stay together and in their order, as its module-scoped fixtures need."""
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(file_of(item.nodeid), index)

    def key(item: pytest.Item) -> tuple[float, int]:
        name = file_of(item.nodeid)
        return (-seconds.get(name, float("inf")), first_seen[name])

    return sorted(items, key=key)


class FileSeconds:
    """Sums each file's setup, call and teardown times as the reports arrive (on
    xdist's controller: every process's reports) and writes them at the end."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self) -> None:
        table = {name: round(s, 1) for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.path.write_text(json.dumps(table, indent=1) + "\n")
