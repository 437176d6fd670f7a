"""The processes a benchmark measures: the services of this tree (tools/processes.py's
launchers, imported here only, so a benchmark names no launcher module), the
services of another revision checked out in a temporary git worktree (a baseline
measured in the same run), a child process running a benchmark's own code from
such a tree, and what the services tell about themselves (Info, JSON log lines)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from proto import worker_pb2, worker_pb2_grpc
from svc_common import defaults
from tools.processes import REPO, Cluster, ServiceProcess, python_path

__all__ = [
    "DEFAULT_MODEL",
    "REPO",
    "Cluster",
    "ServiceProcess",
    "Stack",
    "TreeService",
    "dirty_files",
    "log_events",
    "make_worktree",
    "remove_worktree",
    "require_model",
    "rev_of",
    "run_in_tree",
    "run_timed_tool",
    "tiny_model",
    "worker_info",
]

DEFAULT_MODEL = REPO / defaults.DEFAULT_MODEL


def run_timed_tool(module: str, args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (the child's user + system) of `python -m MODULE ARGS` run to
    its end from this tree, each run in a fresh temporary folder: `{tmp}` in ARGS names it,
    and PAGEDSERVE_GGUF_CACHE points into it (nothing cached between runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDSERVE_GGUF_CACHE": f"{tmp}/gguf"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        argv = [sys.executable, "-m", module, *(a.format(tmp=tmp) for a in args)]
        subprocess.run(argv, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def require_model(path: str | Path) -> Path:
    path = Path(path)
    if not (path / "config.json").exists():
        raise SystemExit(f"{path} missing: run `make model` first")
    return path


def tiny_model(family: str = "llama") -> Path:
    """A tiny random checkpoint of a real architecture (built on first use): the model is
    cheap, so what is measured is the serving machinery around it."""
    from tools.tiny_checkpoints import ensure_checkpoint

    return ensure_checkpoint(family)


def worker_info(address: str, metadata: tuple[tuple[str, str], ...] | None = None) -> worker_pb2.InfoResponse:
    """A worker's Info; `metadata`: the internal token of a Cluster's workers (Cluster.worker_metadata)."""
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        reply: worker_pb2.InfoResponse = stub.Info(worker_pb2.InfoRequest(), metadata=metadata, timeout=30)
    return reply


def log_events(path: Path, event: str) -> list[dict[str, Any]]:
    """The records of a service's JSON log (--log-format json) whose event is `event`."""
    out = []
    with open(path, errors="replace") as log:
        for line in log:
            if not line.startswith("{") or event not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                out.append(record)
    return out


# ---- another revision's tree ------------------------------------------------------------
def rev_of(rev: str) -> str:
    """The short hash of a revision."""
    out = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def make_worktree(rev: str) -> Path:
    """`rev` checked out in a temporary git worktree, its proto stubs generated."""
    path = Path(tempfile.mkdtemp(prefix="pagedserve-baseline-"))
    path.rmdir()
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True, capture_output=True, text=True
    )
    protos = sorted(str(p.relative_to(path)) for p in (path / "proto").glob("*.proto"))
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--grpc_python_out=.", *protos],
        cwd=path,
        check=True,
    )
    return path


def remove_worktree(path: Path) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=REPO, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)


SERVICE_CODE = ("scheduler_svc", "worker_svc", "svc_common", "proto", "models", "kernels")


def dirty_files(root: Path, *also: str) -> list[str]:
    """Uncommitted changes to the service code (and the paths in `also`) in `root`."""
    out = subprocess.run(
        ["git", "status", "--porcelain", "--", *SERVICE_CODE, *also], cwd=root, capture_output=True, text=True
    ).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def run_in_tree(root: Path, argv: list[str], tag: str) -> Any:
    """`python *argv` started from `root` (its code imported: cwd and PYTHONPATH), which
    prints its result as one line `TAG <json>`; that JSON. E.g. the same measurement
    of a baseline revision, in its own process."""
    env = {**os.environ, "PYTHONPATH": python_path(root)}
    proc = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {root} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith(tag + " "))
    return json.loads(line[len(tag) + 1 :])


@dataclass
class TreeService:
    """`python -m MODULE ARGS` with cwd and PYTHONPATH = root, so that a worktree runs its
    own code; on 127.0.0.1, its port read from the ready file. (ServiceProcess runs this tree's.)"""

    root: Path
    module: str
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    _dir: str = ""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self._dir) / "service.log"

    def start(self, timeout_s: float = 180.0) -> TreeService:
        self._dir = tempfile.mkdtemp(prefix="pagedserve-bench-")
        ready = Path(self._dir) / "ready.json"
        env = {**os.environ, "PYTHONPATH": python_path(self.root)}
        cmd = [sys.executable, "-m", self.module, *self.args]
        cmd += ["--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)]
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop(keep_log=True)
                raise RuntimeError(f"{self.module} ({self.root}) did not start:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.05)
        time.sleep(0.05)  # the ready file is written in one go, but be safe
        self.port = json.loads(ready.read_text())["port"]
        return self

    def stop(self, keep_log: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._dir and not keep_log:
            shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Stack:
    """A worker and a scheduler (JSON logs at debug level: one "step" line per step)
    started from one source tree."""

    label: str
    root: Path
    worker_args: list[str]
    scheduler_args: list[str]
    worker: TreeService | None = None
    scheduler: TreeService | None = None

    def start(self) -> Stack:
        self.worker = TreeService(self.root, "worker_svc", self.worker_args).start()
        try:
            logs = ["--log-format", "json", "--log-level", "debug"]
            args = ["--workers", self.worker.address, *self.scheduler_args, *logs]
            self.scheduler = TreeService(self.root, "scheduler_svc", args).start()
        except Exception:
            self.worker.stop()
            raise
        return self

    def stop(self) -> None:
        for s in (self.scheduler, self.worker):
            if s:
                s.stop()

    @property
    def scheduler_address(self) -> str:
        assert self.scheduler is not None, "not started"
        return self.scheduler.address

    def step_lines(self) -> list[dict[str, Any]]:
        """The scheduler's "step" log records so far."""
        assert self.scheduler is not None, "not started"
        return log_events(self.scheduler.log_path, "step")
