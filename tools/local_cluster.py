"""Start N workers, a scheduler and the OpenAI-compatible HTTP gateway as local
processes on 127.0.0.1 and keep them running until Ctrl-C / SIGTERM (what
`make serve` runs).

    python -m tools.local_cluster --model models/SmolLM2-135M-Instruct --workers 1 --port 50051 \\
        --gateway-port 8000
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
from pathlib import Path

from tools.processes import Cluster

PROMPT = "The capital of France is"
QUESTION = "What is 2 + 2?"


def usage(model_id: str, target: str, gateway_url: str | None) -> str:
    """The commands printed once everything serves (each one is meant to be pasted as is)."""
    lines = [
        f"  stream a completion:  .venv/bin/python -m scheduler_svc.client --target {target} "
        f'--max-tokens 32 "{PROMPT}"',
        f'  with grpcurl:         grpcurl -plaintext -d \'{{"prompt": "{PROMPT}", "max_tokens": 32, '
        f'"temperature": 0}}\' {target} serving.v1.Scheduler/Generate',
        f"  stats:                grpcurl -plaintext {target} serving.v1.Scheduler/Stats",
    ]
    if gateway_url is None:
        return "\n".join(lines)
    completion = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True})
    chat = json.dumps(
        {
            "model": model_id,
            "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 64,
            "temperature": 0,
            "stream": True,
        }
    )
    lines += [
        "",
        f"OpenAI-compatible HTTP API on {gateway_url}/v1 (completions, chat/completions, models; /health):",
        "",
        f"  curl -N {gateway_url}/v1/completions -H 'Content-Type: application/json' -d '{completion}'",
        "",
        f"  curl -N {gateway_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{chat}'",
        "",
        "  the openai package (paste as is):",
        "",
        ".venv/bin/python - <<'EOF'",
        "from openai import OpenAI",
        f'client = OpenAI(base_url="{gateway_url}/v1", api_key="unused")',
        f'stream = client.chat.completions.create(model="{model_id}", max_tokens=64, temperature=0, stream=True,',
        f'                                        messages=[{{"role": "user", "content": "{QUESTION}"}}])',
        "for chunk in stream:",
        '    print(chunk.choices[0].delta.content or "", end="", flush=True)',
        "print()",
        "EOF",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes")
    parser.add_argument("--port", type=int, default=50051, help="scheduler port")
    parser.add_argument(
        "--gateway-port", type=int, default=8000, help="HTTP port of the OpenAI-compatible gateway; -1 = no gateway"
    )
    parser.add_argument(
        "--worker-args", default="", help="extra worker flags, e.g. '--dtype bfloat16 --num-blocks 2048'"
    )
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags")
    parser.add_argument("--gateway-args", default="", help="extra gateway flags, e.g. '--model-name smollm2'")
    args = parser.parse_args(argv)
    if not -1 <= args.gateway_port <= 65535:
        parser.error("--gateway-port: must be in 0..65535, or -1 for no gateway")
    with_gateway = args.gateway_port >= 0
    cluster = Cluster(
        Path(args.model),
        shlex.split(args.worker_args),
        shlex.split(args.scheduler_args),
        num_workers=args.workers,
        inherit_output=True,
        scheduler_port=args.port,
        gateway=with_gateway,
        gateway_port=max(args.gateway_port, 0),
        gateway_args=shlex.split(args.gateway_args),
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        target = cluster.address
        model_id = _gateway_model_id(args.model, shlex.split(args.gateway_args))
        workers = ", ".join(w.address for w in cluster.workers)
        print(
            f"""
pagedserve is serving {Path(args.model).name} on {target} ({args.workers} worker(s): {workers})

{usage(model_id, target, cluster.gateway_url if with_gateway else None)}

Ctrl-C stops everything.
""",
            flush=True,
        )
        while not stop.wait(0.5):
            dead = [p.module for p in cluster.processes if p.proc is not None and p.proc.poll() is not None]
            if dead:
                print(f"{', '.join(dead)} exited; stopping", file=sys.stderr)
                return 1
    return 0


def _gateway_model_id(model_dir: str, gateway_args: list[str]) -> str:
    """The id the gateway answers with: --model-name if given, else the directory's name."""
    for i, arg in enumerate(gateway_args):
        if arg.startswith("--model-name="):
            return arg.split("=", 1)[1]
        if arg == "--model-name" and i + 1 < len(gateway_args):
            return gateway_args[i + 1]
    return Path(model_dir).name


if __name__ == "__main__":
    sys.exit(main())
