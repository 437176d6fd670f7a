"""One stream's time per token outside the worker's forward (issue 38: 1-stream ITL against
llama.cpp's on the same GGUF): where a generated token's wall time and CPU time go between
the worker's step, the Step RPC, the scheduler, its Generate stream, the gateway and the
client, in one run.

    python -m bench.itl_split [--gguf Q4_1] [--event-loops uvloop asyncio] [--rounds 3] [--requests 2]

pagedserve as `make serve` runs it on the shipped GGUF (bench.peers' `pagedserve`, the same
`--model FILE.gguf --dtype float32` command, plus a known --metrics-port), once per event
loop the scheduler and gateway run on (PAGEDSERVE_EVENT_LOOP, svc_common/event_loop.py),
all of them up at once (an idle one costs the others almost nothing). Each round, one
stream of 256-token prompts (bench.peers' prompts), greedy, ignore_eos, through two paths:
* gateway: the official openai client, /v1/completions streamed (bench.peers' driver);
* direct: SchedulerClient.stream, the scheduler's serving.v1 Generate (sync gRPC);
each on each cluster (the order of clusters and paths flips every round).

Wall time per token (ms, means over the round's tokens):
* forward: the worker's forward (the layers, not its input building or sampling) as its
  StepResponse reports it, per decode step (the scheduler's
  pagedserve_worker_forward_duration_seconds less the prefill steps, whose whole step
  time, pagedserve_prefill_chunk_duration_seconds, is taken out: a slight underestimate);
* scheduler ITL: the time between two tokens of one request where the scheduler hands
  them to the request's stream (pagedserve_inter_token_latency_seconds): forward plus
  the Step RPC and the scheduler's own per-step work that planning ahead does not hide;
* client ITL: the gaps the client sees (mean per request, median over requests);
  client minus scheduler is the Generate stream (direct) or the stream plus the gateway
  and the HTTP client (gateway).

CPU time per token (ms: /proc's user + system of each process, and of each thread of it,
over the round / tokens received): what each process costs a token, unaffected by how
busy the shared machine is (its wall figures are not). On a 2-core machine the worker's
stepping thread holds one core at 1 stream; everything else shares the other.

Part 2, the Step RPC's transport alone: a 1-sequence decode step's request bytes
(plan_to_proto) echoed by a sync thread-pool server (as the worker serves Step) to a
grpc.aio client (as the scheduler calls it), as a unary call per step (what the scheduler
does) and as messages on one bidirectional stream; CPU of the client's event-loop
thread and of the whole process, per round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import psutil

from bench.harness.llama_cpp import gguf_file
from bench.harness.machine import announce, load_average
from bench.harness.openai_servers import CACHE, RunningServer, drive_completions
from bench.harness.results import markdown_table, write_result
from bench.peers import WORKLOADS, make_prompts, pagedserve, shortened
from svc_common import event_loop
from tools.ports import free_port

NAME = "itl_split"
SERVICES = ("worker_svc", "scheduler_svc", "gateway_svc")
PATHS = ("gateway", "direct")
METRICS = {
    "forward": "pagedserve_worker_forward_duration_seconds",
    "prefill": "pagedserve_prefill_chunk_duration_seconds",
    "scheduler ITL": "pagedserve_inter_token_latency_seconds",
}


def service_processes(root: psutil.Process) -> dict[str, psutil.Process]:
    """The cluster's worker, scheduler and gateway processes under `root`, and this one (the client)."""
    found = {"client": psutil.Process()}
    for child in root.children(recursive=True):
        command = " ".join(child.cmdline())
        found.update({name: child for name in SERVICES if f"-m {name}" in command})
    return found


def thread_cpu(procs: dict[str, psutil.Process]) -> dict[tuple[str, int, str], float]:
    """CPU seconds of every thread, keyed (process, thread id, thread name)."""
    out = {}
    for name, proc in procs.items():
        for thread in proc.threads():
            try:
                with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as comm:
                    label = comm.read().strip()
            except OSError:  # the thread ended meanwhile
                continue
            out[(name, thread.id, label)] = thread.user_time + thread.system_time
    return out


def histograms(metrics_url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in METRICS, over its label sets."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    totals: defaultdict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        totals[name] += float(value)
    return {label: (totals[f"{m}_sum"], totals[f"{m}_count"]) for label, m in METRICS.items()}


def direct_itl(address: str, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    """Median over requests of each one's mean gap between token messages, and the tokens."""
    from scheduler_svc.client import SchedulerClient

    client = SchedulerClient(address)
    itls, tokens = [], 0
    for prompt in prompts:
        arrivals = []
        for message in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
            if message.token_ids:
                arrivals.append(time.perf_counter())
                tokens += len(message.token_ids)
        itls.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
    return statistics.median(itls), tokens


def measure_path(cluster: Cluster, path: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    procs, metrics_url = cluster.procs, cluster.metrics_url
    threads_before, hist_before = thread_cpu(procs), histograms(metrics_url)
    if path == "gateway":
        result = asyncio.run(drive_completions(cluster.running.server.base_url, cluster.model, prompts, 1, max_tokens))
        itl, tokens = result.itl_p50, result.tokens
    else:
        itl, tokens = direct_itl(cluster.scheduler, prompts, max_tokens)
    threads_after, hist_after = thread_cpu(procs), histograms(metrics_url)
    change = {
        label: (total - hist_before[label][0], count - hist_before[label][1])
        for label, (total, count) in hist_after.items()
    }
    # Each request's prefill step is one of the forwards: out, with its whole step time (>= its forward).
    (forwards, steps), (prefills, chunks) = change.pop("forward"), change.pop("prefill")
    wall = {"client ITL": itl * 1e3, "forward": (forwards - prefills) / max(steps - chunks, 1) * 1e3}
    wall.update({label: total / max(count, 1) * 1e3 for label, (total, count) in change.items()})
    per_thread = {k: (v - threads_before.get(k, 0.0)) / tokens * 1e3 for k, v in threads_after.items()}
    per_process: defaultdict[str, float] = defaultdict(float)
    for (name, _, _), ms in per_thread.items():
        per_process[name] += ms
    return {"tokens": tokens, "wall": wall, "process": dict(per_process), "threads": per_thread}


# ---- part 2: the Step RPC's transport ---------------------------------------------------
def step_bytes() -> bytes:
    """A 1-sequence greedy decode step's request as the scheduler serializes it: one token
    at position 300, a 19-block table (a 256-token prompt and 128 out)."""
    from bench.step_wire import plan_of
    from scheduler_svc.engine.worker_client import plan_to_proto

    return plan_to_proto(plan_of(1, 1, 300, 19)).SerializeToString()


def transport(payload: bytes, calls: int) -> dict[str, dict[str, float]]:
    """CPU microseconds per round trip (client loop thread, whole process) and wall, unary and stream."""

    def unary(request: bytes, _: grpc.ServicerContext) -> bytes:
        return request

    def stream(requests: Any, _: grpc.ServicerContext) -> Any:
        yield from requests

    handlers = {
        "U": grpc.unary_unary_rpc_method_handler(unary),
        "S": grpc.stream_stream_rpc_method_handler(stream),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("itl.Echo", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    out: dict[str, dict[str, float]] = {}

    async def run() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        call_unary = channel.unary_unary("/itl.Echo/U")
        bidi = channel.stream_stream("/itl.Echo/S")()

        async def one_stream_trip() -> None:
            await bidi.write(payload)
            await bidi.read()

        async def one_unary_trip() -> None:
            await call_unary(payload)

        for label, trip in (("unary call per step", one_unary_trip), ("one bidirectional stream", one_stream_trip)):
            for _ in range(50):
                await trip()
            thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(calls):
                await trip()
            out[label] = {
                "client loop thread CPU us": (time.thread_time() - thread) / calls * 1e6,
                "process CPU us (client + server)": (time.process_time() - process) / calls * 1e6,
                "wall us": (time.perf_counter() - wall) / calls * 1e6,
            }
        await bidi.done_writing()
        await channel.close()

    try:
        asyncio.run(run())
    finally:
        server.stop(None)
    return out


# ---- the run -------------------------------------------------------------------------------
def serve(gguf: str, port: int, metrics_port: int, loop: str) -> RunningServer:
    server = pagedserve("float32", port, gguf=gguf)
    command = [*server.command, "--metrics-port", str(metrics_port)]
    server = dataclasses.replace(server, command=command, env={**server.env, event_loop.ENV: loop})
    return RunningServer(server, CACHE / "logs" / f"{NAME}-{loop}.log")


@dataclass
class Cluster:
    """One running pagedserve, on one event loop."""

    loop: str
    running: RunningServer
    model: str
    scheduler: str
    metrics_url: str
    procs: dict[str, psutil.Process]

    def measure(self, path: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
        return measure_path(self, path, prompts, max_tokens)


def start(gguf: str, loop: str, ready_timeout: float) -> Cluster:
    port, metrics_port = free_port(), free_port()
    running = serve(gguf, port, metrics_port, loop)
    try:
        _, model = running.wait_ready(ready_timeout)
    except BaseException:
        running.stop()
        raise
    procs = service_processes(psutil.Process(running.proc.pid))
    scheduler = f"127.0.0.1:{port + 100}"  # bench.peers' pagedserve puts it there
    return Cluster(loop, running, model, scheduler, f"http://127.0.0.1:{metrics_port}/metrics", procs)


def rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every cluster stays up (an idle one costs the others almost nothing); each round runs
    each path on each, the order of clusters and paths flipping between rounds."""
    clusters: list[Cluster] = []
    try:
        for loop in args.event_loops:
            clusters.append(start(args.gguf, loop, args.ready_timeout))
        prompts = make_prompts(shortened(WORKLOADS["1"], args.max_tokens, args.requests))
        for cluster in clusters:  # warm both paths
            for path in PATHS:
                cluster.measure(path, prompts[:1], 16)
        records = []
        for i in range(args.rounds):
            order = [(c, p) for c in clusters for p in PATHS]
            for cluster, path in order if i % 2 == 0 else order[::-1]:
                record = cluster.measure(path, prompts, args.max_tokens)
                records.append({"loop": cluster.loop, "path": path, "round": i, "load": load_average(), **record})
                print(f"round {i} {cluster.loop} {path}: {record['wall']} {record['process']}", flush=True)
        return records
    finally:
        for cluster in clusters:
            cluster.running.stop()


def report(records: list[dict[str, Any]], wire: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    variants = [(loop, path) for loop in args.event_loops for path in PATHS]

    def median_of(loop: str, path: str, part: str, key: str) -> float:
        values: list[float] = [r[part].get(key, 0.0) for r in records if (r["loop"], r["path"]) == (loop, path)]
        return statistics.median(values)

    def table(part: str, keys: list[str], unit: str, last: str, value: Callable[[str, str], float]) -> str:
        """One row per (loop, path): the medians of `keys` in `part`, then `last` = value(loop, path)."""
        return markdown_table(
            ["event loop", "path", *[f"{k} {unit}" for k in keys], last],
            [
                [loop, path, *[f"{median_of(loop, path, part, k):.2f}" for k in keys], f"{value(loop, path):.2f}"]
                for loop, path in variants
            ],
        )

    def outside_forward(loop: str, path: str) -> float:
        return median_of(loop, path, "wall", "client ITL") - median_of(loop, path, "wall", "forward")

    def scheduler_and_gateway(loop: str, path: str) -> float:
        return sum(median_of(loop, path, "process", n) for n in ("scheduler_svc", "gateway_svc"))

    wall = table("wall", ["forward", "scheduler ITL", "client ITL"], "ms", "client ITL - forward ms", outside_forward)
    names = ["worker_svc", "scheduler_svc", "gateway_svc", "client"]
    cpu = table("process", names, "CPU ms/token", "scheduler + gateway", scheduler_and_gateway)
    threads = thread_table([r for r in records if r["path"] == "gateway"])
    trips = markdown_table(
        ["Step RPC transport", *next(iter(wire.values())).keys()],
        [[label, *[f"{v:.0f}" for v in row.values()]] for label, row in wire.items()],
    )
    loads = ", ".join(f"{r['load']:.2f}" for r in records)
    return (
        f"pagedserve on the {args.gguf} GGUF (`--dtype float32`), 1 stream of 256-token prompts, "
        f"{args.max_tokens} tokens out, {args.requests} request(s) per path and round, {args.rounds} rounds "
        f"(medians over rounds), the scheduler and gateway on each event loop (PAGEDSERVE_EVENT_LOOP), "
        f"one cluster per loop, all up at once. Load average after each path: {loads}.\n\n"
        f"### Wall time per token (ms)\n\n{wall}\n\n### CPU time per token, by process\n\n{cpu}\n\n"
        f"### CPU time per token, by thread (the gateway path, median round)\n\n{threads}"
        f"\n\n### The Step RPC's transport alone (a {len(step_bytes())}-byte 1-sequence decode step echoed, "
        f"{args.calls} round trips)\n\n{trips}"
    )


def thread_table(records: list[dict[str, Any]]) -> str:
    """Threads by event loop, process and name, a process's threads of one name summed in two
    classes: those above 2 ms/token (the worker's Step calls run on its gRPC pool's threads in
    turn, so its steps spread over several) and the rest."""
    rows: dict[tuple[str, str, str], list[float]] = {}
    counts: dict[tuple[str, str, str], int] = {}
    for record in records:
        summed: Counter[tuple[str, str, str]] = Counter()
        seen: Counter[tuple[str, str, str]] = Counter()
        for (process, _, label), ms in record["threads"].items():
            key = (record["loop"], process, label + (" (> 2 ms each)" if ms > 2 else ""))
            summed[key] += ms
            seen[key] += ms > 0.01
        for key, ms in summed.items():
            rows.setdefault(key, []).append(ms)
            counts[key] = max(counts.get(key, 0), seen[key])
    table = sorted(((statistics.median(v), k) for k, v in rows.items()), key=lambda t: (t[1][0], -t[0]))
    return markdown_table(
        ["event loop", "process", "threads", "how many", "CPU ms/token"],
        [[*k, counts[k], f"{ms:.2f}"] for ms, k in table if ms > 0.02],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default="Q4_1", help="which GGUF (bench.peers' kinds; Q4_1: the shipped file)")
    parser.add_argument("--event-loops", nargs="+", default=list(event_loop.LOOPS), choices=event_loop.LOOPS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per path and round")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000, help="part 2: round trips per transport")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="s (a first run builds the kernels)")
    parser.add_argument("--notes", default="")
    args = parser.parse_args()
    announce(NAME)
    gguf_file(args.gguf)  # made (or found) before anything is timed
    records = rounds(args)
    wire = transport(step_bytes(), args.calls)
    body = report(records, wire, args)
    write_result(NAME, "One stream's time per token outside the worker's forward (issue 38)", body, args.notes)
    print(body)


if __name__ == "__main__":
    main()
