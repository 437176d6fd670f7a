"""--cpu-cores (worker_svc/affinity.py): what it takes, what it refuses by name, and
that a pinned process runs every thread, those it had and those it starts, there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from worker_svc.affinity import cores_problem, parse_cores
from worker_svc.config import WorkerConfig


def test_core_lists_parse():
    assert parse_cores("0") == {0}
    assert parse_cores("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cores(" 1 , 1-2") == {1, 2}
    for bad, says in (("a", "'a' is not a core number"), ("3-1", "'3-1' is an empty range"), ("1,", "'' is not")):
        with pytest.raises(ValueError, match=says):
            parse_cores(bad)


def test_cores_outside_the_process_are_refused_by_flag():
    allowed = sorted(os.sched_getaffinity(0))
    assert cores_problem(str(allowed[0])) is None
    outside = max(allowed) + 1
    assert f"{outside} is not one" in (cores_problem(f"0-{outside}") or "")
    config = WorkerConfig(cpu_cores="x1")
    with pytest.raises(ValueError, match="--cpu-cores: must be a list of cores like 0 or 0-3,6"):
        config.validate()


def test_every_thread_runs_on_the_pinned_core():
    core = min(os.sched_getaffinity(0))
    script = f"""
import json, os, threading
from worker_svc.affinity import pin_to_cores
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
pin_to_cores("{core}")
after = threading.Thread(target=stop.wait); after.start()
masks = {{t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
stop.set(); print(json.dumps(masks))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=os.environ)
    masks = json.loads(out.stdout.splitlines()[-1])
    assert len(masks) >= 3 and all(mask == [core] for mask in masks.values()), masks
