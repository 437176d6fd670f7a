"""A local cluster as detached background processes with pid files (what
`make cluster` / `make down` run): N workers, the scheduler and the gateway on
127.0.0.1 -- the docker-compose.yml topology without containers. With
`--cells C`, C schedulers each with their own N workers, and the gateway in
front of all of them (`--schedulers`): the multi-scheduler topology.

    python -m tools.cluster_ctl up --workers 2 --port 50051    # the default model (local_cluster.py)
    python -m tools.cluster_ctl up --model models/SmolLM2-135M-Instruct --workers 1 --cells 2
    python -m tools.cluster_ctl status
    python -m tools.cluster_ctl down

Everything lives in --run-dir (default run/): <name>.pid, <name>.log and
<name>.ready.json per service, cluster.json with the addresses, and secrets/
(mode 0700): the internal token the scheduler presents to its workers and the
admin key admin.v1 asks for, made anew by every `up`. Each service
runs in its own session and process group, so `down` stops the whole group and
nothing is left behind; a pid is only signalled if /proc says it is still the
process we started (its command line names this run dir), so a stale pid file
never kills an unrelated process that reused the pid.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from svc_common.cli import module_prog
from tools.ports import free_port
from tools.prepare_default_model import served_model
from tools.processes import ClusterSecrets, flag_value, gateway_model_args, kv_roles, prepare_kernels

REPO = Path(__file__).resolve().parent.parent
STOP_ORDER = ("gateway", "scheduler", "worker")  # front to back: no new work reaches a stopped service


@dataclass
class Service:
    name: str  # worker-0, worker-1, scheduler, gateway
    module: str
    args: list[str]
    host: str
    port: int

    def paths(self, run_dir: Path) -> tuple[Path, Path, Path]:
        return run_dir / f"{self.name}.pid", run_dir / f"{self.name}.log", run_dir / f"{self.name}.ready.json"


# ---- process identity ---------------------------------------------------------------
def _cmdline(pid: int) -> list[str] | None:
    """The live (non-zombie) process's argv, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return None
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _ours(pid: int, module: str, run_dir: Path) -> bool:
    argv = _cmdline(pid)
    if not argv or module not in argv:
        return False
    return any(str(run_dir) in a for a in argv)


def _alive_pids(run_dir: Path) -> dict[str, int]:
    """name -> pid for every pid file whose process is still the one we started."""
    alive = {}
    for pid_file in sorted(run_dir.glob("*.pid")):
        name = pid_file.stem
        try:
            pid = int(pid_file.read_text().strip())
        except ValueError:
            continue
        if _ours(pid, _module_of(name), run_dir):
            alive[name] = pid
    return alive


def _module_of(name: str) -> str:
    """worker-3 -> worker_svc, scheduler-1 -> scheduler_svc, gateway -> gateway_svc."""
    return f"{name.split('-')[0]}_svc"


# ---- up -----------------------------------------------------------------------------
def start(service: Service, run_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    pid_file, log_file, ready = service.paths(run_dir)
    ready.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        service.module,
        *service.args,
        "--host",
        service.host,
        "--port",
        str(service.port),
        "--ready-file",
        str(ready),
    ]
    with open(log_file, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pid_file.write_text(f"{proc.pid}\n")
    return proc


def wait_ready(service: Service, proc: subprocess.Popen[bytes], run_dir: Path, deadline: float) -> str:
    """HOST:PORT once the service wrote its ready file; raises with its log if it died or timed out."""
    _, log_file, ready = service.paths(run_dir)
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(
                f"{service.name} exited with {proc.returncode}; its log ({log_file}):\n{_tail(log_file)}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{service.name} not ready in time; its log ({log_file}):\n{_tail(log_file)}")
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    return f"{info['host']}:{info['port']}"


def up(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if alive := _alive_pids(run_dir):
        print(
            f"a cluster is already running from {run_dir} ({', '.join(f'{n} pid {p}' for n, p in alive.items())});"
            f" stop it first with `make down`",
            file=sys.stderr,
        )
        return 1
    for stale in run_dir.glob("*.pid"):
        stale.unlink()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # Workers share the machine's cores instead of each taking all of them.
    env.setdefault("PAGEDSERVE_WORKER_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.workers)))
    served = served_model(args.model, shlex.split(args.worker_args))
    model = str(Path(served.model).resolve())
    if not Path(model).exists():
        print(f"--model {model}: no such file or directory (make cluster MODEL=path)", file=sys.stderr)
        return 2
    # Workers take steps only from their scheduler; admin.v1 needs the admin key (both new each `up`).
    secrets = ClusterSecrets.create(run_dir / "secrets")
    worker_args = ["--model", model, *secrets.worker_args, *served.worker_args]
    addresses: dict[str, str] = {}
    try:
        prepare_kernels(shlex.split(args.worker_args))  # before the workers' start-up clock runs
        deadline = time.monotonic() + args.timeout
        workers = worker_services(args, worker_args)
        procs = [start(w, run_dir, env) for w in workers]  # they load the model in parallel
        for w, p in zip(workers, procs):
            addresses[w.name] = wait_ready(w, p, run_dir, deadline)
            print(f"{w.name:<12} ready on {addresses[w.name]}  (pid {p.pid}, log {w.paths(run_dir)[1]})", flush=True)
        schedulers = [
            _scheduler(cell, workers[cell * args.workers : (cell + 1) * args.workers], addresses, model, args, secrets)
            for cell in range(args.cells)
        ]
        for scheduler in schedulers:
            p = start(scheduler, run_dir, env)
            addresses[scheduler.name] = wait_ready(scheduler, p, run_dir, deadline)
            print(f"{scheduler.name:<12} ready on {addresses[scheduler.name]}  (pid {p.pid})", flush=True)
            admin_port = json.loads(scheduler.paths(run_dir)[2].read_text()).get("admin_port", -1)
            if admin_port >= 0:  # admin.v1: AddWorker, DrainWorker, ListWorkers (loopback by default)
                addresses[scheduler.name.replace("scheduler", "admin")] = f"127.0.0.1:{admin_port}"
        if args.gateway_port >= 0:
            targets = ",".join(addresses[s.name] for s in schedulers)
            # Several cells: the gateway routes each request to one scheduler (gateway_svc/scheduler_pool.py).
            front = ["--schedulers", targets] if args.cells > 1 else ["--scheduler", targets]
            metrics = ",".join(f"{args.host}:{flag_value(s.args, '--metrics-port')}" for s in schedulers)
            gateway = Service(
                "gateway",
                "gateway_svc",
                [*front, "--scheduler-metrics", metrics, *gateway_model_args(model), *shlex.split(args.gateway_args)],
                args.host,
                args.gateway_port,
            )
            p = start(gateway, run_dir, env)
            addresses["gateway"] = wait_ready(gateway, p, run_dir, deadline)
            print(f"{'gateway':<12} ready on http://{addresses['gateway']}  (pid {p.pid})", flush=True)
    except KeyboardInterrupt:
        print("interrupted: stopping what was started", file=sys.stderr)
        stop_all(run_dir, quiet=True)
        return 130
    except Exception as exc:  # anything: never leave half a cluster behind
        print(f"cluster start failed: {exc}", file=sys.stderr)
        stop_all(run_dir, quiet=True)
        return 1
    (run_dir / "cluster.json").write_text(json.dumps(addresses, indent=2) + "\n")
    first = schedulers[0].name
    target = addresses[first]
    lines = [
        f"\npagedserve cluster up: {args.cells} cell(s) of {args.workers} worker(s), "
        + ", ".join(f"{s.name} {addresses[s.name]}" for s in schedulers)
        + (f", gateway http://{addresses['gateway']}" if "gateway" in addresses else ""),
        "",
        f"  stream a completion:  .venv/bin/python -m scheduler_svc.client --target {target} --max-tokens 16 "
        f'"The capital of France is"',
        f"  stats:                grpcurl -plaintext {target} serving.v1.Scheduler/Stats",
    ]
    admin = first.replace("scheduler", "admin")
    if admin in addresses:
        lines.append(
            f'  workers (admin.v1):   grpcurl -plaintext -H "authorization: Bearer $(cat {secrets.admin_key_file})" '
            f"{addresses[admin]} admin.v1.Admin/ListWorkers"
        )
    if "gateway" in addresses:
        lines.append(
            f"  HTTP (OpenAI API):    curl http://{addresses['gateway']}/v1/completions "
            f'-H \'Content-Type: application/json\' -d \'{{"prompt": "The capital of France is", '
            f'"max_tokens": 16, "temperature": 0}}\''
        )
    lines += [f"  logs:                 {run_dir}/*.log", "  stop:                 make down", ""]
    print("\n".join(lines), flush=True)
    return 0


def worker_services(args: argparse.Namespace, worker_args: list[str]) -> list[Service]:
    """Every cell's workers, cell after cell; with --prefill/--decode each cell's prefill
    workers first, then its decode workers (--kv-role)."""
    roles = kv_roles(args.workers, args.prefill, args.decode)
    return [
        Service(
            f"worker-{i}",
            "worker_svc",
            [*worker_args, *roles[i % len(roles)]],
            args.host,
            args.worker_base_port + i if args.worker_base_port else 0,
        )
        for i in range(len(roles) * args.cells)
    ]


def _scheduler(
    cell: int,
    workers: list[Service],
    addresses: dict[str, str],
    model: str,
    args: argparse.Namespace,
    secrets: ClusterSecrets,
) -> Service:
    """Cell `cell`'s scheduler over its workers: `scheduler` when there is one cell,
    else `scheduler-<cell>` on --port + 2 x cell (its admin.v1 takes the port after)."""
    name = "scheduler" if args.cells == 1 else f"scheduler-{cell}"
    port = args.port + 2 * cell if args.port else 0
    flags = ["--model", model, "--workers", ",".join(addresses[w.name] for w in workers), *secrets.scheduler_args]
    # Its Prometheus endpoint, which the gateway's /metrics serves too.
    flags += ["--metrics-port", str(free_port(args.host))]
    return Service(name, "scheduler_svc", [*flags, *shlex.split(args.scheduler_args)], args.host, port)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


# ---- down ---------------------------------------------------------------------------
def _signal_group(pid: int, sig: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)  # the service and anything it spawned
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds while only zombies are left: look for a live member.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def stop_all(run_dir: Path, timeout_s: float = 20.0, quiet: bool = False) -> int:
    alive = _alive_pids(run_dir)
    order = sorted(alive, key=lambda n: (STOP_ORDER.index(n.split("-")[0]), n))
    for tier in STOP_ORDER:
        names = [n for n in order if n.split("-")[0] == tier]
        for name in names:
            _signal_group(alive[name], signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in names:
            pid = alive[name]
            while _group_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _group_alive(pid):
                print(f"{name} (pid {pid}) ignored SIGTERM for {timeout_s}s: SIGKILL", file=sys.stderr)
                _signal_group(pid, signal.SIGKILL)
                while _group_alive(pid):
                    time.sleep(0.05)
            if not quiet:
                print(f"stopped {name} (pid {pid})")
    for path in [*run_dir.glob("*.pid"), *run_dir.glob("*.ready.json"), run_dir / "cluster.json"]:
        path.unlink(missing_ok=True)
    if not alive and not quiet:
        print(f"nothing running from {run_dir}")
    return 0


def status(run_dir: Path) -> int:
    """Every service `up` started: running, or dead (exit 1: a dead service is never left out)."""
    alive = _alive_pids(run_dir)
    cluster = run_dir / "cluster.json"
    addresses = json.loads(cluster.read_text()) if cluster.exists() else {}
    started = {p.stem: _read_pid(p) for p in sorted(run_dir.glob("*.pid"))}
    if not started:
        print(f"nothing running from {run_dir}")
        return 1
    dead = sorted(started.keys() - alive.keys())
    for name in sorted(started):
        state = "running" if name in alive else "DEAD   "
        log = f"  (log {run_dir / f'{name}.log'})" if name in dead else ""
        print(f"{name:<12} {state} pid {started[name]:<8} {addresses.get(name, '?')}{log}")
    if dead:
        print(f"{len(dead)} of {len(started)} services are dead: {', '.join(dead)} (`make down`, then `make cluster`)")
        return 1
    return 0


def _read_pid(pid_file: Path) -> int | str:
    try:
        return int(pid_file.read_text().strip())
    except ValueError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=module_prog("tools.cluster_ctl"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", default=str(REPO / "run"), help="pid, log and ready files")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start workers, scheduler and gateway in the background")
    p_up.add_argument("--run-dir", default=argparse.SUPPRESS)
    p_up.add_argument(
        "--model",
        default="",
        help="the model to serve: a checkpoint directory or a .gguf file (make cluster MODEL=); default: the shipped "
        "GGUF on CPU workers, its converted checkpoint on CUDA ones (tools/prepare_default_model.py)",
    )
    p_up.add_argument("--workers", type=int, default=2, help="workers per cell")
    p_up.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="disaggregation (make cluster PREFILL=): prefill workers per cell (--kv-role prefill), with --decode; "
        "replaces --workers",
    )
    p_up.add_argument(
        "--decode", type=int, default=0, help="disaggregation (make cluster DECODE=): decode workers per cell"
    )
    p_up.add_argument(
        "--cells",
        type=int,
        default=1,
        help="schedulers, each with its own --workers workers; with more than one the gateway fronts them all "
        "(--schedulers)",
    )
    p_up.add_argument("--host", default="127.0.0.1", help="address every service binds")
    p_up.add_argument("--port", type=int, default=50051, help="scheduler port")
    p_up.add_argument(
        "--worker-base-port",
        "--worker-port",
        type=int,
        default=0,
        help="worker i binds this + i (make cluster WORKER_PORT=); 0 = ports picked by the OS",
    )
    p_up.add_argument("--gateway-port", type=int, default=8000, help="HTTP gateway port; -1 = no gateway")
    p_up.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16 --num-blocks 2048'")
    p_up.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    p_up.add_argument("--gateway-args", default="", help="extra gateway flags")
    p_up.add_argument("--timeout", type=float, default=300.0, help="seconds for everything to become ready")
    for name, helptext in (("down", "stop everything started by `up`"), ("status", "list the running services")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--run-dir", default=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.command == "up":
        if args.workers < 1:
            parser.error("--workers: must be >= 1")
        if args.cells < 1:
            parser.error("--cells: must be >= 1")
        try:
            args.workers = len(kv_roles(args.workers, args.prefill, args.decode))  # PREFILL + DECODE, if set
        except ValueError as exc:
            parser.error(f"--prefill/--decode: {exc}")
        return up(args)
    run_dir = Path(args.run_dir).resolve()
    if args.command == "down":
        return stop_all(run_dir) if run_dir.is_dir() else 0
    return status(run_dir)


if __name__ == "__main__":
    sys.exit(main())
