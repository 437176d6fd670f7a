"""A first run's commands, with real processes: `make cluster`'s launcher serves
another model (the tiny Llama) with its workers on WORKER_PORT, +1; the client
streams from a scheduler that wants an API key (--api-key or $PAGEDSERVE_API_KEY)
and fails cleanly without one; a service stopped mid-start (as at its start-up timeout)
leaves no child behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from scheduler_svc.client import API_KEY_ENV, SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO, ServiceProcess, free_port

KEY = "sk-first-run"
PROMPT = "The capital of France is"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=600)


def _live(text: str) -> bool:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                return True
        except OSError:
            continue
    return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    worker_port = free_port()
    while not all(_free(worker_port + i) for i in range(2)):
        worker_port = free_port()
    model = tiny_checkpoint("llama")
    up = _run(
        "-m", "tools.cluster_ctl", "--run-dir", str(run_dir), "up", "--model", str(model), "--workers", "2",
        "--port", "0", "--worker-port", str(worker_port), "--gateway-port", "-1",
        "--worker-args", "--dtype float32 --num-blocks 64", "--scheduler-args", f"--api-keys {KEY} --admin-port 0",
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield json.loads((run_dir / "cluster.json").read_text()), worker_port
    finally:
        _run("-m", "tools.cluster_ctl", "--run-dir", str(run_dir), "down")


def _free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_cluster_serves_another_model_on_the_given_worker_ports(cluster):
    addresses, worker_port = cluster
    assert addresses["worker-0"] == f"127.0.0.1:{worker_port}"
    assert addresses["worker-1"] == f"127.0.0.1:{worker_port + 1}"


def test_the_client_sends_the_api_key_from_its_flag_or_the_environment(cluster):
    target = cluster[0]["scheduler"]
    with SchedulerClient(target, api_key=KEY) as reference:
        expected = reference.generate(PROMPT, max_tokens=8, temperature=0.0, timeout=120).text
    assert expected
    flag = _run("-m", "scheduler_svc.client", "--target", target, "--max-tokens", "8", "--api-key", KEY, PROMPT)
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == expected
    env = _run("-m", "scheduler_svc.client", "--target", target, "--max-tokens", "8", PROMPT, **{API_KEY_ENV: KEY})
    assert env.returncode == 0 and env.stdout == expected, env.stderr
    without = _run("-m", "scheduler_svc.client", "--target", target, PROMPT, **{API_KEY_ENV: ""})
    assert without.returncode == 1 and "error: UNAUTHENTICATED" in without.stderr


def test_a_service_stopped_mid_start_leaves_no_child():
    stall = f"{900 + uuid.uuid4().int % 1000 / 1000:.3f}"
    service = ServiceProcess("tests.helpers.stalling_service", [stall], stop_timeout_s=5.0)
    service.launch()
    try:
        _wait(lambda: _live(f"sleep {stall}"), "the service's child")
        assert not service.poll_ready()
    finally:
        service.stop()  # what a start-up timeout does
    _wait(lambda: not _live(f"sleep {stall}"), "the end of the service's child")


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)
