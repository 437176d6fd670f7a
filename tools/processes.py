"""Run the real services as subprocesses on 127.0.0.1 with OS-picked ports.

Each service writes its bound port to a ready file once it serves; a service
that dies or stays silent past the timeout raises with its log. Every service
runs in a process group of its own, which stop() ends whole (nothing it started
outlives it, also when it is stopped mid-start). Used by the tests, the
benchmarks and `make serve` (tools/local_cluster.py, which starts them
`supervised`: in sessions of their own, so a terminal's Ctrl-C reaches only the
launcher, and with a parent-death signal, so none outlives it). A cluster builds
the C++ CPU kernels before its workers start (prepare_kernels)."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from svc_common.gguf_sidecar import is_gguf_path, model_files, served_name

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def python_path(root: Path) -> str:
    """PYTHONPATH for a service started from `root`: its code first, then what this
    process was given (packages installed beside the interpreter, e.g. a GPU machine's)."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(root), inherited] if inherited else [str(root)])


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when the thread that started it ends
    (its parent dies, however it dies: even SIGKILL), as PR_SET_PDEATHSIG does."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


@dataclass(frozen=True)
class ClusterSecrets:
    """What a launcher hands its services so that only they can reach each other: the
    internal token (workers take steps only from its holder, the scheduler) and an
    admin key (admin.v1 and the KV events), each in a file only this user can read."""

    internal_token_file: Path
    admin_key_file: Path

    @classmethod
    def create(cls, directory: Path) -> ClusterSecrets:
        """New random secrets in `directory` (made if missing, mode 0700)."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        made = cls(directory / "internal.token", directory / "admin.key")
        for path in (made.internal_token_file, made.admin_key_file):
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(24) + "\n")
        return made

    @property
    def admin_key(self) -> str:
        return self.admin_key_file.read_text().strip()

    @property
    def admin_metadata(self) -> tuple[tuple[str, str]]:
        """gRPC call metadata for admin.v1."""
        return (("authorization", f"Bearer {self.admin_key}"),)

    @property
    def worker_metadata(self) -> tuple[tuple[str, str]]:
        """gRPC call metadata for a worker's own calls (what its scheduler presents)."""
        return (("authorization", f"Bearer {self.internal_token_file.read_text().strip()}"),)

    @property
    def worker_args(self) -> list[str]:
        return ["--internal-token-file", str(self.internal_token_file)]

    @property
    def scheduler_args(self) -> list[str]:
        return [*self.worker_args, "--admin-keys-file", str(self.admin_key_file)]


@dataclass
class ServiceProcess:
    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # A hang detector, not a speed limit: a process that dies is seen at once (poll), and
    # a worker's imports alone took over 120 s on 2 cores at load 20+ (two checkouts'
    # suites and other work side by side).
    timeout_s: float = 600.0
    inherit_output: bool = False  # True: log to our stdout/stderr instead of a file
    bind_port: int = 0  # 0: the OS picks; the bound port is read back into `port`
    # Own session (a terminal's signals do not reach it) and SIGTERM when the thread that
    # started it ends: only for processes started and restarted from one long-lived thread.
    supervised: bool = False
    stop_timeout_s: float = 15.0  # SIGTERM, then this long before SIGKILL
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    ready_info: dict[str, Any] = field(default_factory=dict)  # the ready file's JSON (the scheduler adds admin_port)
    _dir: tempfile.TemporaryDirectory[str] | None = None
    _deadline: float = 0.0
    _group_ended: bool = False  # stop() has ended what was left of proc's process group

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self._dir is not None, "not started"
        return Path(self._dir.name) / "service.log"

    @property
    def ready_path(self) -> Path:
        assert self._dir is not None, "not started"
        return Path(self._dir.name) / "ready.json"

    def launch(self) -> None:
        """Start the process; `poll_ready()` says when it serves."""
        self._dir = tempfile.TemporaryDirectory(prefix="pagedserve-")
        env = {**os.environ, "PYTHONPATH": python_path(REPO), **self.env}
        cmd = [
            sys.executable,
            "-m",
            self.module,
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.bind_port),
            "--ready-file",
            str(self.ready_path),
        ]
        # A process group of its own either way: stop() ends whatever it started with it.
        options: dict[str, Any] = {"cwd": REPO, "env": env, "process_group": 0}
        if self.supervised:
            options = {"cwd": REPO, "env": env, "start_new_session": True, "preexec_fn": die_with_parent}
        if self.inherit_output:
            self.proc = subprocess.Popen(cmd, **options)
        else:
            with open(self.log_path, "w") as out:  # the child keeps its own copy of the descriptor
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **options)
        self._deadline = time.monotonic() + self.timeout_s
        self._group_ended = False

    def poll_ready(self) -> bool:
        """True once the service serves (its port read back); raises if it died or timed out."""
        assert self.proc is not None, "not launched"
        if self.ready_path.exists():
            self.ready_info = json.loads(self.ready_path.read_text())
            self.port = self.ready_info["port"]
            return True
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.module} exited with {self.proc.returncode}:\n{self.log()}")
        if time.monotonic() > self._deadline:
            self.stop()
            raise TimeoutError(f"{self.module} not ready after {self.timeout_s}s:\n{self.log()}")
        return False

    def start(self) -> ServiceProcess:
        self.launch()
        while not self.poll_ready():
            time.sleep(0.05)
        return self

    @property
    def admin_address(self) -> str:
        """The scheduler's admin.v1 service (from its ready file)."""
        port = self.ready_info.get("admin_port", -1)
        if port < 0:
            raise RuntimeError(f"{self.module} serves no admin service (--admin-port -1, or not a scheduler)")
        return f"127.0.0.1:{port}"

    def log(self) -> str:
        if not self._dir or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-6000:]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> ServiceProcess:
        """Stop if still running (e.g. after kill()), then start again on the same
        port, as a supervisor would: clients keep using the address they know."""
        self.relaunch()
        while not self.poll_ready():
            time.sleep(0.05)
        return self

    def relaunch(self) -> None:
        """restart() without waiting: `poll_ready()` says when it serves again."""
        self.stop()
        self.bind_port = self.port or self.bind_port
        self.launch()

    def stop(self) -> None:
        """SIGTERM (it drains and stops its own children), SIGKILL after stop_timeout_s;
        then SIGKILL to whatever of its process group is left (a child of a service
        stopped mid-start, or killed), so no test leaves an orphan behind."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc and not self._group_ended:  # once: a long-dead group's id may be reused
            kill_group(self.proc.pid)
            self._group_ended = True
        if self._dir:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kv_roles(num_workers: int, prefill: int = 0, decode: int = 0) -> list[list[str]]:
    """Each worker's --kv-role flags. Disaggregation (make serve PREFILL=P DECODE=D):
    P prefill workers, then D decode workers, in place of `num_workers`; without it
    `num_workers` workers with no role flag (both). ValueError naming what is wrong."""
    if prefill < 0 or decode < 0:
        raise ValueError(f"PREFILL and DECODE must be >= 0, got {prefill} and {decode}")
    if not (prefill or decode):
        return [[] for _ in range(num_workers)]
    if not (prefill and decode):
        raise ValueError(
            f"PREFILL={prefill} DECODE={decode}: a disaggregated fleet needs both prefill and decode workers"
        )
    return [["--kv-role", "prefill"]] * prefill + [["--kv-role", "decode"]] * decode


class Cluster:
    """A worker (or several) and a scheduler in front of them, as real processes;
    with `gateway=True` also the OpenAI-compatible HTTP gateway in front of the
    scheduler (`gateway_url` is its base URL). `worker_port`: worker i binds
    worker_port + i (0: the OS picks); `metrics_port` > 0: the scheduler's
    Prometheus endpoint, which the gateway's /metrics then serves too. The
    workers take steps only from the scheduler (an internal token it makes) and
    admin.v1 needs `secrets.admin_metadata`; `secure=False` starts them without."""

    def __init__(
        self,
        model_dir: Path,
        worker_args: Sequence[str] = (),
        scheduler_args: Sequence[str] = (),
        num_workers: int = 1,
        inherit_output: bool = False,
        scheduler_port: int = 0,
        gateway: bool = False,
        gateway_port: int = 0,
        gateway_args: Sequence[str] = (),
        worker_port: int = 0,
        metrics_port: int = 0,
        supervised: bool = False,
        secure: bool = True,
        prefill: int = 0,
        decode: int = 0,
    ):
        self.model_dir = model_dir
        self.supervised = supervised
        # Removed with this object (or at exit), not by stop(): a restarted service reads them again.
        self._secrets_dir = tempfile.TemporaryDirectory(prefix="pagedserve-secrets-") if secure else None
        self.secrets = ClusterSecrets.create(Path(self._secrets_dir.name)) if self._secrets_dir else None
        own = self.secrets.worker_args if self.secrets else []
        self.workers = [
            ServiceProcess(
                "worker_svc",
                ["--model", str(model_dir), *own, *worker_args, *role],
                inherit_output=inherit_output,
                bind_port=worker_port + i if worker_port else 0,
                supervised=supervised,
            )
            for i, role in enumerate(kv_roles(num_workers, prefill, decode))
        ]
        self.metrics_port = metrics_port
        self.scheduler_args = list(scheduler_args)
        self.inherit_output = inherit_output
        self.scheduler_port = scheduler_port
        self.scheduler: ServiceProcess | None = None
        self.with_gateway = gateway
        self.gateway_port = gateway_port
        self.gateway_args = list(gateway_args)
        self.gateway: ServiceProcess | None = None

    @property
    def address(self) -> str:
        assert self.scheduler is not None, "not started"
        return self.scheduler.address

    @property
    def gateway_url(self) -> str:
        """http://127.0.0.1:PORT of the gateway (the OpenAI base URL is this + /v1)."""
        if self.gateway is None:
            raise RuntimeError("this cluster was started without a gateway (Cluster(..., gateway=True))")
        return f"http://{self.gateway.address}"

    @property
    def admin_metadata(self) -> tuple[tuple[str, str]] | None:
        """gRPC call metadata for the scheduler's admin.v1 (None: started with secure=False)."""
        return self.secrets.admin_metadata if self.secrets else None

    @property
    def worker_metadata(self) -> tuple[tuple[str, str]] | None:
        """gRPC call metadata for calling the workers directly (Info), as the scheduler does."""
        return self.secrets.worker_metadata if self.secrets else None

    @property
    def processes(self) -> list[ServiceProcess]:
        """Every started service process: workers, scheduler, gateway."""
        return [p for p in (*self.workers, self.scheduler, self.gateway) if p is not None and p.proc is not None]

    def start(self) -> Cluster:
        try:
            prepare_kernels(self.workers[0].args if self.workers else ())
            for w in self.workers:  # they load their models side by side
                w.launch()
            while not all(w.poll_ready() for w in self.workers):
                time.sleep(0.05)
            workers = ",".join(w.address for w in self.workers)
            # An OS-picked scheduler port goes with an OS-picked admin port (not the fixed default).
            admin = (
                ["--admin-port", "0"]
                if self.scheduler_port == 0 and not any(a.startswith("--admin-port") for a in self.scheduler_args)
                else []
            )
            metrics = ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []
            own = self.secrets.scheduler_args if self.secrets else []
            self.scheduler = ServiceProcess(
                "scheduler_svc",
                ["--model", str(self.model_dir), "--workers", workers, *own, *admin, *metrics, *self.scheduler_args],
                inherit_output=self.inherit_output,
                bind_port=self.scheduler_port,
                supervised=self.supervised,
            ).start()
            if self.with_gateway:
                scrape = ["--scheduler-metrics", f"127.0.0.1:{self.metrics_port}"] if self.metrics_port else []
                self.gateway = ServiceProcess(
                    "gateway_svc",
                    ["--scheduler", self.scheduler.address, *gateway_model_args(self.model_dir), *scrape]
                    + self.gateway_args,
                    inherit_output=self.inherit_output,
                    bind_port=self.gateway_port,
                    supervised=self.supervised,
                    # It drains first: give it its --drain-timeout-s and a margin before SIGKILL.
                    stop_timeout_s=float(flag_value(self.gateway_args, "--drain-timeout-s") or 30.0) + 10.0,
                ).start()
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        # Front to back: the gateway's streams end before the scheduler goes away.
        if self.gateway:
            self.gateway.stop()
        if self.scheduler:
            self.scheduler.stop()
        for w in self.workers:
            w.stop()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in the group `pgid` (a stopped service's)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def prepare_kernels(worker_args: Sequence[str] = (), timeout_s: float = 3600.0) -> None:
    """Build (or wait for) the C++ CPU kernels before any worker starts, saying so, so
    that no worker spends its start-up timeout on a compile (kernels/build_cache.py).
    Nothing to do where they are built, turned off, or the workers run on CUDA; a
    build that fails is the workers' business (they warn and run the reference ops)."""
    from kernels import cpu_build  # torch-free until it loads the library

    if not cpu_build.enabled() or worker_device(worker_args).startswith("cuda") or cpu_build.LIBRARY.built():
        return
    print(
        "[kernels] building the C++ CPU kernels before the workers start (once per machine and source; "
        f"~1-2 min on 2 cores) into {cpu_build.LIBRARY.path().parent}",
        file=sys.stderr,
        flush=True,
    )
    build = subprocess.Popen(
        [sys.executable, "-m", "kernels.cpu_build"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": python_path(REPO)},
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop it (below)
    )
    try:
        build.wait(timeout_s)
    except BaseException:  # Ctrl-C, a timeout: its compile child stops with it
        build.kill()
        build.wait()
        raise


def worker_device(worker_args: Sequence[str]) -> str:
    """The --device the workers started with these flags run on (the flag, else their env var, else cpu)."""
    return flag_value(worker_args, "--device") or os.environ.get("PAGEDSERVE_WORKER_DEVICE", "cpu")


def gateway_model_args(model: Path | str) -> list[str]:
    """The gateway's --model-dir (its chat template; a GGUF model's: the folder extracted
    from it once) and, for a GGUF file, the model id (svc_common.gguf_sidecar.served_name:
    else the id would be that folder's hashed name). Flags given after these win."""
    named = ["--served-model-name", served_name(model)] if is_gguf_path(model) else []
    return ["--model-dir", str(model_files(model)), *named]


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag` in a command line (`--flag V` or `--flag=V`; the last one wins), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == flag and i + 1 < len(args):
            value = args[i + 1]
    return value
