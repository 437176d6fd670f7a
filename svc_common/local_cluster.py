"""Start a scheduler and N workers as local processes on 127.0.0.1 and keep them
running until Ctrl-C / SIGTERM (what `make serve` runs).

    python -m svc_common.local_cluster --model models/SmolLM2-135M-Instruct --workers 1 --port 50051
"""
from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
from pathlib import Path

from svc_common.processes import Cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument("--port", type=int, default=50051, help="scheduler port")
    parser.add_argument("--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16 --num-blocks 2048'")
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    args = parser.parse_args(argv)
    cluster = Cluster(Path(args.model), shlex.split(args.worker_args), shlex.split(args.scheduler_args),
                      num_workers=args.workers, inherit_output=True, scheduler_port=args.port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        target = cluster.address
        print(f"""
pagedserve is serving {Path(args.model).name} on {target} ({args.workers} worker(s): {', '.join(w.address for w in cluster.workers)})

  stream a completion:  .venv/bin/python -m scheduler_svc.client --target {target} --max-tokens 32 "The capital of France is"
  with grpcurl:         grpcurl -plaintext -d '{{"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0}}' {target} serving.v1.Scheduler/Generate
  stats:                grpcurl -plaintext {target} serving.v1.Scheduler/Stats

Ctrl-C stops everything.
""", flush=True)
        while not stop.wait(0.5):
            dead = [p.module for p in [cluster.scheduler, *cluster.workers] if p.proc.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
