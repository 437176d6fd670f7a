"""What a first run types works as printed: every service's --help names the command
that runs it, the client explains every flag, `make serve` / `make cluster` pass
MODEL and WORKER_PORT to their launchers (and leave the default model's choice and
preparation to them), and the launchers build the kernels before any worker starts."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

import pytest

from kernels import cpu_build
from scheduler_svc import client
from tools import processes
from tools.processes import REPO

COMMANDS = [
    "worker_svc",
    "scheduler_svc",
    "gateway_svc",
    "scheduler_svc.client",
    "tools.local_cluster",
    "tools.cluster_ctl",
]


def _run(*cmd: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", COMMANDS)
def test_help_names_the_command_that_runs_it(module):
    done = _run(sys.executable, "-m", module, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m {module} ")


def test_the_client_explains_every_flag_and_reads_the_api_key_from_the_environment(monkeypatch, capsys):
    parsers: list[argparse.ArgumentParser] = []
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", lambda self, argv=None: parsers.append(self) or exit())
    monkeypatch.setenv(client.API_KEY_ENV, "k-from-env")
    with pytest.raises(SystemExit):
        client.main(["hi"])
    actions = [a for a in parsers[0]._actions if not isinstance(a, argparse._HelpAction)]
    assert {a.dest for a in actions} >= {"prompt", "target", "api_key", "max_tokens", "temperature", "stop"}
    assert all(a.help for a in actions), [a.dest for a in actions if not a.help]
    assert next(a for a in actions if a.dest == "api_key").default == "k-from-env"


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["serve", "cluster", "serve-worker"])
def test_make_hands_model_and_worker_port_to_the_launcher(target, tmp_path):
    done = _run("make", "-n", "--no-print-directory", target, f"MODEL={tmp_path}", "WORKER_PORT=52561")
    assert done.returncode == 0, done.stderr
    command = [line for line in done.stdout.splitlines() if "-m tools." in line or "-m worker_svc" in line]
    assert command, done.stdout
    flag = "--serve" if target == "serve-worker" else "--model"  # serve-worker: the tool prints the worker's flags
    assert f'{flag} "{tmp_path}" ' in done.stdout
    assert "--worker-port 52561" in done.stdout or "--port 52561" in done.stdout
    assert "prepare_default_model --out" not in done.stdout  # another model: the default one is not converted


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["serve", "cluster", "serve-worker"])
def test_make_leaves_the_default_model_to_the_launcher(target, tmp_path):
    """Without MODEL the launcher picks the default for the workers' device and prepares
    it (tests/unit/test_default_model.py): make converts nothing itself."""
    done = _run("make", "-n", "--no-print-directory", target, f"MODEL_DIR={tmp_path}")  # its config.json: missing
    assert done.returncode == 0, done.stderr
    flag = "--serve" if target == "serve-worker" else "--model"
    assert f'{flag} "" ' in done.stdout and "prepare_default_model --out" not in done.stdout


def test_launchers_build_nothing_where_the_kernels_are_built(monkeypatch):
    if not cpu_build.load():
        pytest.skip("the C++ CPU kernels cannot be built here")
    monkeypatch.setattr(processes.subprocess, "Popen", lambda *a, **k: pytest.fail("started a build"))
    processes.prepare_kernels()


def test_launchers_build_the_kernels_before_the_workers_and_say_so(monkeypatch, tmp_path, capfd):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "pagedserve-no-such-g++")  # a build that fails at once
    processes.prepare_kernels(["--device", "cuda"])  # GPU workers: nothing to build
    assert capfd.readouterr().err == ""
    processes.prepare_kernels(["--dtype", "float32"])  # fails: the workers warn and run the reference ops
    err = capfd.readouterr().err
    assert "[kernels] building the C++ CPU kernels before the workers start" in err
    assert "pagedserve-no-such-g++: not found" in err
