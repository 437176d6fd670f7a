"""The HTTP gateway's added latency: time to first text (TTFT: the first gRPC
message or SSE event that carries text) and total time of sequential streaming
requests through the gateway (httpx, /v1/completions with "stream": true,
server-sent events) beside the same requests sent straight to the scheduler's
gRPC API (SchedulerClient.stream), interleaved, in the same run, against the
same worker + scheduler processes.

    python -m bench.gateway_overhead --requests 20 --max-tokens 32

Greedy with ignore_eos, so both paths generate the same tokens (the texts are
compared); prefix caching is off, so that whichever path goes second does not
find the prompt cached; the order alternates per pair anyway. A second part runs
the same pairs against an in-process stub scheduler that answers at once, which
isolates the gateway's own cost from the model's and the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx

from bench.harness.machine import announce
from bench.harness.results import markdown_table, median, write_result
from bench.harness.services import REPO, Cluster, ServiceProcess
from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.client import SchedulerClient

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three uses of a paperclip:",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "The best way to learn programming is",
    "Once upon a time in a small village,",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
]


def via_gateway(http: httpx.Client, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(time to first text, total, text) of one streamed /v1/completions request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    ttft, text, done = None, [], False
    with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True  # read on to the end of the body, as clients do: the connection stays reusable
                continue
            piece = json.loads(data)["choices"][0]["text"]
            if piece and ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
    total = time.perf_counter() - start
    if not done or ttft is None:
        raise RuntimeError(f"incomplete event stream for {prompt!r}")
    return ttft, total, "".join(text)


def via_grpc(client: SchedulerClient, prompt: str, max_tokens: int) -> tuple[float, float, str]:
    """(time to first text, total, text) of one serving.v1 Generate stream."""
    start = time.perf_counter()
    ttft, text = None, []
    for reply in client.stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=300):
        # First *text*, as on the gateway path: a token whose text is empty (a special token
        # such as <|im_end|> under ignore_eos, or bytes of an unfinished character) makes no SSE chunk.
        if reply.text and ttft is None:
            ttft = time.perf_counter() - start
        text.append(reply.text)
    total = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError(f"no token for {prompt!r}")
    return ttft, total, "".join(text)


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


class InstantScheduler(serving_pb2_grpc.SchedulerServicer):
    """A serving.v1 stub that answers at once (no model, no queue): what is left of
    the latency is the clients', the gateway's and the transport's own."""

    def Generate(self, request, context):
        n = request.max_tokens if request.HasField("max_tokens") else 16
        for i in range(n):
            yield serving_pb2.GenerateResponse(request_id=request.request_id, text=" x", token_ids=[i])
        yield serving_pb2.GenerateResponse(
            request_id=request.request_id,
            finished=True,
            finish_reason="length",
            usage=serving_pb2.Usage(prompt_tokens=1, completion_tokens=n),
        )


def measure(
    http: httpx.Client, grpc_client: SchedulerClient, requests: int, max_tokens: int, warm_up: int = 2
) -> dict[str, list[tuple[float, float, str]]]:
    """`requests` pairs (gateway, gRPC) of the same prompt, the order alternating per pair."""
    paths = {
        "gateway": lambda p: via_gateway(http, p, max_tokens),
        "grpc": lambda p: via_grpc(grpc_client, p, max_tokens),
    }
    for _ in range(warm_up):  # connections, first-step costs
        for name in paths:
            paths[name](PROMPTS[0])
    results: dict[str, list[tuple[float, float, str]]] = {"gateway": [], "grpc": []}
    for i in range(requests):
        prompt = PROMPTS[i % len(PROMPTS)]
        order = ("gateway", "grpc") if i % 2 == 0 else ("grpc", "gateway")  # drift hits both alike
        for name in order:
            results[name].append(paths[name](prompt))
    return results


def rows_for(label: str, results: dict[str, list[tuple[float, float, str]]]) -> list[list[str]]:
    def stats(values: list[float]) -> list[str]:
        return [ms(median(values)), ms(p90(values))]

    def path_row(name: str, path: str) -> list[str]:
        rs = results[name]
        return [label, path, *stats([r[0] for r in rs]), *stats([r[1] for r in rs])]

    pairs = list(zip(results["gateway"], results["grpc"]))
    med = {name: (median([r[0] for r in rs]), median([r[1] for r in rs])) for name, rs in results.items()}
    return [
        path_row("grpc", "direct gRPC (SchedulerClient.stream)"),
        path_row("gateway", "HTTP gateway (httpx, SSE /v1/completions)"),
        [
            label,
            "**added by the gateway** (per-pair difference)",
            *stats([g[0] - d[0] for g, d in pairs]),
            *stats([g[1] - d[1] for g, d in pairs]),
        ],
        [
            label,
            "ratio gateway / gRPC (of the medians)",
            f"{med['gateway'][0] / med['grpc'][0]:.2f}x",
            "",
            f"{med['gateway'][1] / med['grpc'][1]:.2f}x",
            "",
        ],
    ]


def main() -> None:
    announce("gateway_overhead")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--requests", type=int, default=20, help="requests per path (sequential, interleaved)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--stub-requests",
        type=int,
        default=100,
        help="requests per path against the instant stub scheduler; 0 = skip that part",
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with (
        Cluster(
            Path(args.model), ["--dtype", args.dtype, "--num-blocks", "1024"], ["--no-prefix-caching"], gateway=True
        ) as cluster,
        SchedulerClient(cluster.address) as grpc_client,
        httpx.Client(base_url=cluster.gateway_url, timeout=300) as http,
    ):
        results = measure(http, grpc_client, args.requests, args.max_tokens)
    load_after = os.getloadavg()[0]
    same_text = sum(g[2] == d[2] for g, d in zip(results["gateway"], results["grpc"]))
    rows = rows_for(f"{Path(args.model).name} ({args.dtype})", results)
    if args.stub_requests:
        stub = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        serving_pb2_grpc.add_SchedulerServicer_to_server(InstantScheduler(), stub)
        port = stub.add_insecure_port("127.0.0.1:0")
        stub.start()
        gateway = ServiceProcess(
            "gateway_svc", ["--scheduler", f"127.0.0.1:{port}", "--model-dir", "", "--log-level", "warning"]
        )
        try:
            with (
                gateway,
                SchedulerClient(f"127.0.0.1:{port}") as stub_client,
                httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as http,
            ):
                rows += rows_for(
                    "instant stub scheduler (no model)",
                    measure(http, stub_client, args.stub_requests, args.max_tokens, warm_up=5),
                )
        finally:
            stub.stop(0)
    table = markdown_table(
        ["scheduler", "path", "median TTFT ms", "p90 TTFT ms", "median total ms", "p90 total ms"], rows
    )
    notes = (
        f"{args.requests} sequential requests per path on the model, interleaved (order alternating per pair), "
        f"{args.max_tokens} tokens each (greedy, ignore_eos), prefix caching off; greedy texts identical on "
        f"both paths: {same_text}/{args.requests}. 1-minute load average {load_before:.1f} before, "
        f"{load_after:.1f} after, on {os.cpu_count()} cores: the gateway is a third process on the request's "
        "path, and on a busy machine it waits for a core too, so the model rows carry that noise. "
        + (
            f"The stub rows ({args.stub_requests} pairs, {args.max_tokens} one-token messages each, answered "
            "at once) isolate the gateway's own cost: HTTP parsing and validation, the gRPC hop, JSON and SSE "
            "framing."
            if args.stub_requests
            else ""
        )
    )
    print(table, "\n\n" + notes)
    print(f"wrote {write_result('gateway_overhead', 'Gateway overhead: HTTP/SSE vs direct gRPC', table, notes)}")


if __name__ == "__main__":
    main()
