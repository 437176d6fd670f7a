"""`make down` (tools.cluster_ctl): stops the whole process group of each
service it started, and never signals a process a stale pid file points at."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tools import cluster_ctl

# Looks like a service started by `up` (names the module and the run dir), spawns
# a child into its process group, and optionally ignores SIGTERM.
FAKE = """
import signal, subprocess, sys, time
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[-1], "w").write(str(child.pid))
time.sleep(120)
"""


def fake_service(run_dir: Path, name: str, module: str, mode: str = "polite") -> tuple[subprocess.Popen, int]:
    marker = run_dir / f"{name}.child"
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE, mode, module, "--ready-file", str(marker)], start_new_session=True
    )
    (run_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + 20
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return proc, int(marker.read_text())


def alive(pid: int) -> bool:
    return cluster_ctl._cmdline(pid) is not None


def test_down_stops_process_groups_and_spares_strangers(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    worker, worker_child = fake_service(run_dir, "worker-0", "worker_svc")
    scheduler, scheduler_child = fake_service(run_dir, "scheduler", "scheduler_svc", mode="stubborn")
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    (run_dir / "gateway.pid").write_text(f"{stranger.pid}\n")  # a stale pid file, reused pid
    (run_dir / "worker-1.pid").write_text("999999999\n")  # a dead one
    try:
        assert cluster_ctl._alive_pids(run_dir) == {"worker-0": worker.pid, "scheduler": scheduler.pid}
        assert cluster_ctl.stop_all(run_dir, timeout_s=1.0) == 0
        for proc in (worker, scheduler):
            proc.wait(10)  # reap: they were our children here
        assert scheduler.returncode == -9  # ignored SIGTERM, got SIGKILL
        deadline = time.monotonic() + 10
        while (alive(worker_child) or alive(scheduler_child)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker_child) and not alive(scheduler_child)
        assert stranger.poll() is None  # not ours: untouched
        assert not list(run_dir.glob("*.pid"))
    finally:
        stranger.kill()
        stranger.wait()
        for proc in (worker, scheduler):
            if proc.poll() is None:
                proc.kill()


def test_down_and_status_with_nothing_running(tmp_path, capsys):
    assert cluster_ctl.main(["--run-dir", str(tmp_path / "absent"), "down"]) == 0
    (tmp_path / "run").mkdir()
    assert cluster_ctl.main(["--run-dir", str(tmp_path / "run"), "status"]) == 1
    assert "nothing running" in capsys.readouterr().out


def test_service_names_map_to_their_modules():
    """Several cells name their schedulers scheduler-0, scheduler-1, ... (make cluster CELLS=N)."""
    assert [cluster_ctl._module_of(n) for n in ("worker-12", "scheduler", "scheduler-1", "gateway")] == [
        "worker_svc",
        "scheduler_svc",
        "scheduler_svc",
        "gateway_svc",
    ]


def test_status_reports_a_dead_service_and_fails(tmp_path, capsys):
    """`make cluster-status` never leaves a dead worker out (it exited 0 listing the live ones)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    scheduler, _ = fake_service(run_dir, "scheduler", "scheduler_svc")
    worker, _ = fake_service(run_dir, "worker-0", "worker_svc")
    try:
        assert cluster_ctl.main(["--run-dir", str(run_dir), "status"]) == 0
        capsys.readouterr()
        worker.kill()
        worker.wait(10)
        assert cluster_ctl.main(["--run-dir", str(run_dir), "status"]) == 1
        out = capsys.readouterr().out
        assert f"worker-0     DEAD    pid {worker.pid}" in out and "scheduler    running" in out
        assert "1 of 2 services are dead: worker-0" in out
    finally:
        cluster_ctl.stop_all(run_dir, timeout_s=1.0, quiet=True)
        scheduler.wait(10)
