"""Worker load: Step latency and throughput at batch sizes 1..256, driven directly
over gRPC (no scheduler). For each batch size: one prefill step of B sequences x
--context tokens, then up to --decode-steps decode steps of B x 1 token (bounded
by --seconds-per-batch). Latency is the client's round trip; forward is what the
worker reports.

    python -m tests.load.worker_step [--model DIR] [--dtype bfloat16] [--batches 1,2,4,...]
"""

from __future__ import annotations

import argparse
import time

import grpc

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.worker_client import BLOCK_SIZE as BLOCK
from tests.helpers.worker_client import sampled_rows, seq_step, step_request
from tests.load.common import default_model, fail, percentile, print_table
from tools.processes import ServiceProcess

LIMIT = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


def run_batch(stub, batch: int, context: int, decode_steps: int, budget_s: float, vocab: int) -> list:
    per_seq = -(-(context + decode_steps) // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompts = [[(7 * i + j) % (vocab - 4) + 4 for j in range(context)] for i in range(batch)]
    started = time.perf_counter()
    prefill = [seq_step(i, prompts[i], 0, tables[i], logits=False) for i in range(batch)]
    reply = stub.Step(step_request(0, prefill), timeout=600)
    prefill_ms = (time.perf_counter() - started) * 1e3
    last = {t.seq_id: t.token_id for t in sampled_rows(reply)}
    latencies, forwards, request_bytes = [], [], 0
    deadline = time.monotonic() + budget_s
    for step in range(decode_steps):
        if time.monotonic() > deadline:
            break
        request = step_request(
            step + 1, [seq_step(i, [last[i]], context + step, tables[i], logits=False) for i in range(batch)]
        )
        request_bytes = request.ByteSize()
        started = time.perf_counter()
        reply = stub.Step(request, timeout=120)
        latencies.append((time.perf_counter() - started) * 1e3)
        forwards.append(reply.timings.forward_ms)
        sampled = sampled_rows(reply)
        if len(sampled) != batch:
            fail(f"batch {batch}: {len(sampled)} sampled tokens")
        last = {t.seq_id: t.token_id for t in sampled}
    total_s = sum(latencies) / 1e3
    return [
        batch,
        len(latencies),
        percentile(latencies, 50),
        percentile(latencies, 99),
        percentile(forwards, 50),
        batch * len(latencies) / total_s,
        prefill_ms,
        batch * context / (prefill_ms / 1e3),
        request_bytes,
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--seconds-per-batch", type=float, default=8.0)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    blocks = max(batches) * -(-(args.context + args.decode_steps) // BLOCK)
    model = args.model or default_model()
    with ServiceProcess("worker_svc", ["--model", model, "--dtype", args.dtype, "--num-blocks", str(blocks)]) as proc:
        with grpc.insecure_channel(proc.address, options=LIMIT) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            info = stub.Info(worker_pb2.InfoRequest(), timeout=30)
            run_batch(stub, 4, args.context, 4, args.seconds_per_batch, info.vocab_size)  # warm-up, not reported
            rows = [
                run_batch(stub, b, args.context, args.decode_steps, args.seconds_per_batch, info.vocab_size)
                for b in batches
            ]
    print_table(
        f"worker Step: {info.model_name} ({info.model_type}, {args.dtype}, {info.device}), "
        f"context {args.context}, decode steps of B x 1 token",
        [
            "batch",
            "steps",
            "p50 ms",
            "p99 ms",
            "forward p50 ms",
            "decode tok/s",
            "prefill ms",
            "prefill tok/s",
            "step bytes",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
