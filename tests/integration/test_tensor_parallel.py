"""Tensor-parallel workers (--tensor-parallel-size N, gloo on CPU, fp32) as real
processes: the same Steps (prefills, decodes, a block copy, a decode that takes
its input from the previous step's sample) give logits within 1e-4 of the
one-rank worker and the same tokens, for GQA with KV heads split (TP=2) and
replicated (TP=4, MQA too), Gemma's sliding windows, and the Triton kernels
under the interpreter; Info reports the ranks and each rank's KV bytes; behind
the real scheduler greedy streams equal transformers'; and a rank that dies
takes its worker down, whose requests the scheduler moves to another worker."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, wait_idle
from tests.helpers.procs import ServiceProcess
from tests.helpers.recorder import Recorder, join, wait_for
from tests.helpers.sweeps import sweep
from tests.helpers.worker_client import by_seq, logits_of, seq_step, step_request

NUM_BLOCKS = 64
ATOL = 1e-4


def worker_args(family: str, *extra: str) -> list[str]:
    return ["--model", str(tiny_checkpoint(family)), "--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), *extra]


@contextlib.contextmanager
def stub_of(proc: ServiceProcess):
    with grpc.insecure_channel(proc.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def scripted_steps(stub) -> list[tuple[int, np.ndarray]]:
    """(token, logits) of every sample of a fixed script of steps."""
    a, b = list(range(5, 45)), [7, 300, 11, 42] * 5  # 40 and 20 tokens
    out = []

    def run(step_id, seqs, copies=(), previous=None):
        reply = by_seq(stub.Step(step_request(step_id, seqs, copies, previous), timeout=120))
        out.extend((reply[s.seq_id].token_id, logits_of(reply[s.seq_id])) for s in seqs if s.sample)
        return reply

    first = run(1, [seq_step(1, a, 0, [0, 1, 2]), seq_step(2, b, 0, [3, 4])])
    # Sequence 3 shares sequence 1's full blocks and gets a copy of its partial one (copy-on-write).
    second = run(
        2,
        [
            seq_step(1, [first[1].token_id], 40, [0, 1, 2]),
            seq_step(2, [first[2].token_id], 20, [3, 4]),
            seq_step(3, [9], 40, [0, 1, 6]),
        ],
        copies=[(2, 6)],
    )
    # A decode whose input is the token step 2 sampled, named, not sent (overlapped scheduling).
    third = seq_step(1, [0], 41, [0, 1, 2])
    third.token_from_previous_step = True
    run(3, [third, seq_step(3, [second[3].token_id], 41, [0, 1, 6])], previous=2)
    return out


@pytest.fixture(scope="module")
def references():
    """One-rank workers, started once per family, and their script's samples."""
    cache: dict[tuple[str, str], list] = {}
    procs: list[ServiceProcess] = []

    def reference(family: str, backend: str = "torch") -> list[tuple[int, np.ndarray]]:
        if (family, backend) not in cache:
            proc = ServiceProcess("worker_svc", worker_args(family, "--attention-backend", backend)).start()
            procs.append(proc)
            with stub_of(proc) as stub:
                cache[(family, backend)] = scripted_steps(stub)
        return cache[(family, backend)]

    yield reference
    for p in procs:
        p.stop()


# `make test` keeps Phi-3 (fused projections split and partial-rotary rows permuted before
# slicing); the others, the Triton kernels on each rank among them, are slow.
@pytest.mark.parametrize(
    ("family", "size", "backend"),
    sweep(
        [
            ("llama", 2, "torch"),  # 4 query heads, 2 KV heads: one each
            ("llama", 4, "torch"),  # 2 KV heads on 4 ranks, each replicated twice
            ("qwen3_mqa", 4, "torch"),  # one KV head on every rank; q/k norms
            ("gemma3", 2, "torch"),  # sliding-window layers, sandwich norms, tied embeddings
            ("llama", 2, "triton"),  # the Triton kernels (interpreter) on each rank
            ("llama_bias", 2, "torch"),  # q/k/v/gate/up biases sliced, o/down biases added once
            ("phi3", 2, "torch"),  # fused qkv/gate_up split and partial-rotary rows permuted before slicing
        ],
        keep=[("phi3", 2, "torch")],
    ),
)
def test_logits_and_tokens_match_one_rank(family, size, backend, references):
    want = references(family, backend)
    args = worker_args(family, "--tensor-parallel-size", str(size), "--attention-backend", backend)
    with ServiceProcess("worker_svc", args) as proc, stub_of(proc) as stub:
        info = stub.Info(worker_pb2.InfoRequest(), timeout=30)
        got = scripted_steps(stub)
    cfg = json.loads((tiny_checkpoint(family) / "config.json").read_text())
    local_kv = max(1, cfg["num_key_value_heads"] // size)
    assert (info.tensor_parallel_size, info.num_q_heads, info.num_kv_heads) == (
        size,
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    per_rank = 2 * cfg["num_hidden_layers"] * local_kv * info.block_size * info.head_dim * 4  # K and V, fp32
    assert info.kv_bytes_per_block_per_rank == per_rank and info.kv_bytes_per_block == size * per_rank
    assert info.num_blocks == NUM_BLOCKS
    assert len(got) == len(want) == 7
    for (token, logits), (want_token, want_logits) in zip(got, want):
        assert np.abs(logits - want_logits).max() < ATOL
        assert token == want_token


@pytest.fixture(scope="module")
def reference_model():
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()


def scheduler(workers: list[ServiceProcess], *args: str) -> ServiceProcess:
    addresses = ",".join(w.address for w in workers)
    return ServiceProcess(
        "scheduler_svc",
        ["--model", str(tiny_checkpoint("llama")), "--workers", addresses, "--admin-port", "-1", *args],
    )


def start_streams(client: SchedulerClient, count: int, max_tokens: int) -> list[Recorder]:
    rng = np.random.default_rng(3)
    recorders = [
        Recorder(client, [int(t) for t in rng.integers(4, 700, int(rng.integers(8, 40)))], max_tokens)
        for _ in range(count)
    ]
    for r in recorders:
        r.start()
    return recorders


def assert_exact(recorders: list[Recorder], reference_model) -> None:
    for r in recorders:
        assert r.error is None, f"{r.error.code()}: {r.error.details()}"
        want = hf_greedy(reference_model, r.prompt_ids, r.max_tokens)
        assert r.tokens == want and r.finish_reason == ("length" if len(want) == r.max_tokens else "stop")


def rank_pids(worker: ServiceProcess) -> list[int]:
    """The other ranks' process ids, from the worker's JSON "worker ready" line."""
    records = (json.loads(line) for line in worker.log_path.read_text().splitlines() if line.startswith("{"))
    return next(r for r in records if r.get("event") == "worker ready")["rank_pids"]


def test_greedy_streams_through_the_scheduler_equal_transformers(reference_model):
    args = worker_args("llama", "--tensor-parallel-size", "2", "--log-format", "json")
    with ServiceProcess("worker_svc", args) as worker, scheduler([worker]) as sched:
        (rank_pid,) = rank_pids(worker)
        with SchedulerClient(sched.address) as client:
            recorders = start_streams(client, 6, 24)  # steps planned ahead: decodes name the last sample
            join(recorders)
            assert_exact(recorders, reference_model)
            assert wait_idle(client).blocks_used == 0
    # SIGTERM: rank 0 drains, stops the other rank, exits 0; nothing is left behind.
    assert worker.proc.returncode == 0
    assert not os.path.exists(f"/proc/{rank_pid}")  # stopped and reaped by rank 0


def test_a_rank_that_dies_takes_the_worker_down_and_its_requests_move(reference_model):
    tp_args = worker_args("llama", "--tensor-parallel-size", "2", "--log-format", "json")
    with ThreadPoolExecutor(2) as pool:
        tp, plain = pool.map(
            ServiceProcess.start,
            [ServiceProcess("worker_svc", tp_args), ServiceProcess("worker_svc", worker_args("llama"))],
        )
    try:
        (rank_pid,) = rank_pids(tp)
        sched_args = ("--max-num-seqs", "2", "--health-interval-s", "0.2", "--log-format", "json")
        with scheduler([tp, plain], *sched_args) as sched, SchedulerClient(sched.address) as client:
            recorders = start_streams(client, 8, 48)
            wait_for(lambda: sum(len(r.tokens) > 0 for r in recorders) >= 4, 60, "streams on both workers")
            os.kill(rank_pid, signal.SIGKILL)
            tp.proc.wait(60)
            assert tp.proc.returncode == 1  # down, not hanging in a collective
            join(recorders, 120)
            assert_exact(recorders, reference_model)
            assert wait_idle(client).blocks_used == 0
            log = sched.log_path.read_text()
            assert f'"worker": "{tp.address}"' in log and "worker lost" in log
            assert "worker rejected step" not in log  # UNAVAILABLE (lost), never INTERNAL
            assert f'"src": "{tp.address}"' in log  # its requests moved to the other worker
        # Found by the step that was running (its collective failed) or by rank 0's watch.
        tp_log = tp.log_path.read_text()
        assert "tensor-parallel worker failed: going down" in tp_log and '"event": "worker down"' in tp_log
    finally:
        tp.stop()
        plain.stop()
