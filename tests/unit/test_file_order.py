"""make test's file order (tests/helpers/file_order.py): longest file first, an
unknown file before all, each file's tests together and in their order; and the
seconds a run records, summed per file."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.helpers.file_order import TABLE, FileSeconds, load, longest_first


def _items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=n) for n in nodeids]


def test_the_longest_file_goes_first_and_a_file_stays_whole():
    items = _items("a.py::t1", "a.py::t2", "b.py::t1", "new.py::t1", "c.py::t1", "b.py::t2", "a.py::t3")
    seconds = {"a.py": 5.0, "b.py": 90.0, "c.py": 5.0}
    order = [i.nodeid for i in longest_first(items, seconds)]  # type: ignore[arg-type]
    # new.py is not in the table: taken as long. a.py and c.py tie: collection order.
    assert order == ["new.py::t1", "b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2", "a.py::t3", "c.py::t1"]


def test_a_run_records_each_files_seconds(tmp_path):
    path = tmp_path / "seconds.json"
    recorder = FileSeconds(path)
    for nodeid, duration in [("a.py::t1", 1.25), ("a.py::t2", 2.0), ("b.py::t[x]", 7.5), ("a.py::t2", 0.5)]:
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=duration))  # type: ignore[arg-type]
    recorder.pytest_sessionfinish()
    assert json.loads(path.read_text()) == {"b.py": 7.5, "a.py": 3.8}
    assert list(load(path)) == ["b.py", "a.py"]  # longest first, as written


def test_the_table_names_files_that_exist():
    """A renamed or removed file left in the table would order nothing: refresh it."""
    root = TABLE.parent.parent
    missing = [name for name in load() if not (root / name).exists()]
    assert not missing, f"tests/file_seconds.json names files that are gone: {missing}"
