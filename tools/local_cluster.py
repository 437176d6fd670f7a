"""Start N workers, a scheduler and the OpenAI-compatible HTTP gateway as local
processes on 127.0.0.1 and supervise them until Ctrl-C / SIGTERM (what
`make serve` runs).

    python -m tools.local_cluster --workers 1 --port 50051 --gateway-port 8000

* Without --model: the default for the workers' device (tools/prepare_default_model.py:
  the shipped GGUF on a CPU, its converted checkpoint on CUDA), prepared once first.
* Every port is checked before anything loads; a taken one is one line naming
  the Makefile variable or flag that moves it.
* A service that dies is started again on its port, after a backoff (1 s,
  doubling up to 30 s; a line says why); the scheduler's failover keeps the
  streams of a dead worker alive meanwhile. One that keeps dying at start
  stops everything.
* Ctrl-C, SIGTERM or SIGHUP drain, front to back: the gateway lets streams
  finish for --drain-timeout-s and then ends them with an error event and
  [DONE]; then the scheduler, then the workers. A second signal stops at once.
* Nothing outlives the launcher: the services run in sessions of their own
  (a terminal's Ctrl-C reaches only the launcher, which orders the drain) with
  a parent-death signal (SIGTERM when the launcher dies, even by SIGKILL), and
  the launcher itself gets SIGTERM when its parent (`make`) dies.
* The scheduler's Prometheus endpoint is served on the gateway's /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from svc_common.cli import module_prog
from svc_common.gguf_sidecar import served_name
from tools.ports import PortTaken, PortUse, check_ports, free_port
from tools.prepare_default_model import served_model
from tools.processes import Cluster, ServiceProcess, die_with_parent, flag_value, kv_roles

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long: the next death starts the backoff over
MAX_FAILED_STARTS = 5  # deaths in a row without staying up STABLE_S: give up

PROMPT = "The capital of France is"
QUESTION = "What is 2 + 2?"


@dataclass(frozen=True)
class Example:
    """One example the banner prints: a comment saying what it does, then lines that
    paste as is into a shell in the checkout, using only what `make serve` installed."""

    what: str
    command: str


def examples(
    python: str, model_id: str, target: str, gateway_url: str | None, admin: tuple[str, Path] | None
) -> list[Example]:
    """The banner's examples; `admin`: the admin.v1 address and the admin key's file (None: no admin service)."""
    found = [
        Example(
            "stream a completion over gRPC (serving.v1)",
            f'{python} -m scheduler_svc.client --target {target} --max-tokens 32 "{PROMPT}"',
        ),
        Example(
            "the scheduler's live view, one frame",
            f"{python} -m scheduler_svc.observability.top --target {target} --once",
        ),
    ]
    if admin is not None:
        address, key_file = admin
        found.append(
            Example(
                "the workers (admin.v1, with the admin key this launcher made)",
                "\n".join(
                    [
                        f"{python} - <<'EOF'",
                        "import grpc",
                        "from proto import admin_pb2, admin_pb2_grpc",
                        f'auth = [("authorization", "Bearer " + open("{key_file}").read().strip())]',
                        f'admin = admin_pb2_grpc.AdminStub(grpc.insecure_channel("{address}"))',
                        "print(admin.ListWorkers(admin_pb2.ListWorkersRequest(), metadata=auth))",
                        "EOF",
                    ]
                ),
            )
        )
    if gateway_url is None:
        return found
    completion = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True})
    chat = {"model": model_id, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64, "temperature": 0}
    json_header = "-H 'Content-Type: application/json'"
    found += [
        Example(
            "a completion over HTTP, streamed as server-sent events",
            f"curl -sN {gateway_url}/v1/completions {json_header} -d '{completion}'",
        ),
        Example(
            "a chat completion over HTTP",
            f"curl -s {gateway_url}/v1/chat/completions {json_header} -d '{json.dumps(chat)}'",
        ),
        Example(
            "the chat, streamed, from Python with httpx (make serve installs it; the openai package\n"
            f'# works too: {python} -m pip install openai, then OpenAI(base_url="{gateway_url}/v1", api_key="unused"))',
            "\n".join(
                [
                    f"{python} - <<'EOF'",
                    "import json, httpx",
                    f"body = { ({**chat, 'stream': True})!r}",
                    f'with httpx.stream("POST", "{gateway_url}/v1/chat/completions", json=body, timeout=120) as reply:',
                    "    reply.raise_for_status()",
                    "    for line in reply.iter_lines():",
                    '        if line.startswith("data: ") and line != "data: [DONE]":',
                    '            delta = json.loads(line[6:])["choices"][0]["delta"]',
                    '            print(delta.get("content") or "", end="", flush=True)',
                    "print()",
                    "EOF",
                ]
            ),
        ),
    ]
    return found


def shell_python() -> str:
    """This interpreter as the user can type it here: relative inside the working
    directory (`.venv/bin/python` under `make serve`), else absolute."""
    relative = os.path.relpath(sys.executable)
    return sys.executable if relative.startswith("..") else relative


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not -1 <= args.gateway_port <= 65535:
        _parser().error("--gateway-port: must be in 0..65535, or -1 for no gateway")
    if args.workers < 1:
        _parser().error("--workers: must be >= 1")
    try:
        args.workers = len(kv_roles(args.workers, args.prefill, args.decode))  # PREFILL + DECODE, if set
    except ValueError as exc:
        _parser().error(f"--prefill/--decode: {exc}")
    parent = os.getppid()
    die_with_parent(signal.SIGTERM)  # `make` (our parent: the recipe execs us) died: drain and stop
    if os.getppid() != parent:
        return 1  # it died before we asked
    signals = _Signals()
    scheduler_args = ["--drain-timeout-s", str(args.drain_timeout_s), *shlex.split(args.scheduler_args)]
    gateway_args = ["--drain-timeout-s", str(args.drain_timeout_s), *shlex.split(args.gateway_args)]
    metrics_port = free_port() if args.metrics_port == 0 else max(args.metrics_port, 0)
    try:
        check_ports("127.0.0.1", _port_uses(args, scheduler_args, metrics_port))
    except PortTaken as exc:
        print(f"make serve: {exc}", file=sys.stderr)
        return 1
    served = served_model(args.model, shlex.split(args.worker_args))  # after the ports: this may take a while
    args.model = served.model
    if not Path(args.model).exists():
        _parser().error(f"--model {args.model}: no such file or directory (make serve MODEL=path)")
    with_gateway = args.gateway_port >= 0
    cluster = Cluster(
        Path(args.model),
        served.worker_args,
        scheduler_args,
        num_workers=args.workers,
        inherit_output=True,
        scheduler_port=args.port,
        gateway=with_gateway,
        gateway_port=max(args.gateway_port, 0),
        gateway_args=gateway_args,
        worker_port=args.worker_port,
        metrics_port=metrics_port,
        supervised=True,
        prefill=args.prefill,
        decode=args.decode,
    )
    try:
        cluster.start()
    except KeyboardInterrupt:  # a signal while loading: nothing serves yet, stop what started
        print("interrupted while starting: stopping", file=sys.stderr)
        cluster.stop()
        return 130
    except (RuntimeError, TimeoutError) as exc:  # a service died or hung at start: its log is in the message
        print(f"make serve: could not start: {exc}", file=sys.stderr)
        cluster.stop()
        return 1
    signals.serving = True
    model_id = flag_value(gateway_args, "--model-name") or flag_value(gateway_args, "--served-model-name")
    print(_banner(args, cluster, model_id or served_name(args.model), with_gateway), flush=True)
    supervisor = Supervisor(_names(cluster))
    code = 0
    while not signals.stop.wait(0.5):
        if not supervisor.check():
            code = 1
            break
    print(f"stopping: requests in flight get up to {args.drain_timeout_s:g} s", file=sys.stderr, flush=True)
    try:
        cluster.stop()
    except KeyboardInterrupt:
        print("second signal: stopping at once", file=sys.stderr)
        for process in cluster.processes:
            process.kill()
            process.stop()
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=module_prog("tools.local_cluster"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default="",
        help="the model to serve: a checkpoint directory or a .gguf file (make serve MODEL=); default: the shipped "
        "GGUF on CPU workers, its converted checkpoint on CUDA ones (tools/prepare_default_model.py)",
    )
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="disaggregation (make serve PREFILL=): prefill workers (--kv-role prefill), with --decode; "
        "replaces --workers",
    )
    parser.add_argument(
        "--decode", type=int, default=0, help="disaggregation (make serve DECODE=): decode workers (--kv-role decode)"
    )
    parser.add_argument("--port", type=int, default=50051, help="scheduler port (its admin.v1 takes the next one)")
    parser.add_argument("--worker-port", type=int, default=0, help="worker i binds this + i; 0 = ports the OS picks")
    parser.add_argument(
        "--gateway-port", type=int, default=8000, help="HTTP port of the OpenAI-compatible gateway; -1 = no gateway"
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="the scheduler's Prometheus port (also served on the gateway's /metrics); 0 = a free one, -1 = none",
    )
    parser.add_argument(
        "--drain-timeout-s", type=float, default=30.0, help="on Ctrl-C / SIGTERM: how long requests may still run"
    )
    parser.add_argument(
        "--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16 --num-blocks 2048'"
    )
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--model-name smollm2'")
    return parser


def _port_uses(args: argparse.Namespace, scheduler_args: list[str], metrics_port: int) -> list[PortUse]:
    admin = int(flag_value(scheduler_args, "--admin-port") or 0) or args.port + 1
    uses = [
        PortUse(args.worker_port + i, f"worker {i}", "WORKER_PORT=... or --worker-port") for i in range(args.workers)
    ]
    uses += [
        PortUse(args.port, "the scheduler", "SCHEDULER_PORT=... or --port"),
        PortUse(admin, "the scheduler's admin.v1, --port + 1", "SCHEDULER_PORT=..., or --admin-port in SCHEDULER_ARGS"),
        PortUse(metrics_port, "the scheduler's metrics", "METRICS_PORT=... or --metrics-port"),
    ]
    if args.gateway_port >= 0:
        uses.append(PortUse(args.gateway_port, "the HTTP gateway", "GATEWAY_PORT=... or --gateway-port"))
    return uses


class _Signals:
    """SIGINT, SIGTERM, SIGHUP: the first asks for a drain (while starting: stop now), the next one hurries."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.stop.is_set() or not self.serving:
            self.stop.set()
            raise KeyboardInterrupt
        self.stop.set()


def _names(cluster: Cluster) -> dict[str, ServiceProcess]:
    names = {f"worker-{i}": w for i, w in enumerate(cluster.workers)}
    names |= {name: p for name, p in (("scheduler", cluster.scheduler), ("gateway", cluster.gateway)) if p is not None}
    return names


@dataclass
class _Watch:
    up_since: float
    failures: int = 0  # deaths in a row without staying up STABLE_S
    restart_at: float | None = None  # dead: relaunch at this time
    starting: bool = False  # relaunched, not ready yet


class Supervisor:
    """Restarts dead services on their ports, with backoff; check() is False once one keeps dying."""

    def __init__(self, services: dict[str, ServiceProcess]) -> None:
        self.services = services
        self.watch = {name: _Watch(time.monotonic()) for name in services}

    def check(self) -> bool:
        now = time.monotonic()
        for name, process in self.services.items():
            watch = self.watch[name]
            if watch.starting:
                try:
                    if process.poll_ready():
                        watch.starting, watch.up_since = False, now
                        _say(f"{name} is back on {process.address} (pid {_pid(process)})")
                    continue
                except (RuntimeError, TimeoutError):
                    watch.starting = False  # died (or hung) while starting: a death like any other
            elif watch.restart_at is None and process.proc is not None and process.proc.poll() is None:
                continue
            if watch.restart_at is None:
                if now - watch.up_since >= STABLE_S:
                    watch.failures = 0
                if watch.failures >= MAX_FAILED_STARTS:
                    _say(f"{name} died {watch.failures} times in a row without staying up: stopping everything")
                    return False
                delay = BACKOFF_S[min(watch.failures, len(BACKOFF_S) - 1)]
                watch.failures += 1
                watch.restart_at = now + delay
                _say(
                    f"{name} (pid {_pid(process)}, {process.address}) {_exit_reason(process)}; "
                    f"restarting it in {delay:g} s (restart {watch.failures})"
                )
            if now >= watch.restart_at:
                watch.restart_at, watch.starting = None, True
                process.relaunch()
        return True


def _say(line: str) -> None:
    print(f"supervisor: {line}", file=sys.stderr, flush=True)


def _pid(process: ServiceProcess) -> int | str:
    return process.proc.pid if process.proc is not None else "?"


def _exit_reason(process: ServiceProcess) -> str:
    code = process.proc.returncode if process.proc is not None else None
    if code is None:
        return "did not become ready"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def _banner(args: argparse.Namespace, cluster: Cluster, model_id: str, with_gateway: bool) -> str:
    assert cluster.scheduler is not None and cluster.secrets is not None
    target = cluster.address
    workers = ", ".join(w.address for w in cluster.workers)
    port = cluster.scheduler.ready_info.get("admin_port", -1)
    admin = (f"127.0.0.1:{port}", cluster.secrets.admin_key_file) if port >= 0 else None
    gateway_url = cluster.gateway_url if with_gateway else None
    http = (
        f"OpenAI-compatible HTTP API on {gateway_url}/v1 (completions, chat/completions, models; /health, /metrics)\n"
        if gateway_url
        else ""
    )
    shown = "\n\n".join(
        f"# {e.what}\n{e.command}" for e in examples(shell_python(), model_id, target, gateway_url, admin)
    )
    return f"""
pagedserve is serving {Path(args.model).name} on {target} ({args.workers} worker(s): {workers})
{http}
Examples (each pastes as is into a shell in this directory):

{shown}

Ctrl-C drains and stops everything (a second Ctrl-C stops at once).
"""


if __name__ == "__main__":
    sys.exit(main())
