"""Faults with real processes: a worker SIGKILLed mid-stream (restarted on its
port, or with a second worker taking over), a worker that does not come back,
and graceful shutdown (SIGTERM) of the scheduler and of a worker. Greedy streams
that survive a fault must still equal transformers' tokens, none repeated."""

from __future__ import annotations

import random
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, hf_greedy, load_model, scheduler_of, wait_idle
from tests.helpers.procs import ServiceProcess
from tests.helpers.recorder import Recorder, join, wait_for
from tests.helpers.worker_client import sampled_rows, seq_step, step_request

MODEL = tiny_checkpoint("llama")
WORKER_ARGS = ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "4096"]


@pytest.fixture(scope="module")
def reference():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def shared_worker():
    with ServiceProcess("worker_svc", WORKER_ARGS) as worker:
        yield worker


@pytest.fixture()
def worker(shared_worker):
    """The module's worker, running (a test before may have killed it)."""
    if shared_worker.proc.poll() is not None:
        shared_worker.restart()
    return shared_worker


def start_streams(client: SchedulerClient, count: int, max_tokens: int, seed: int) -> list[Recorder]:
    rng = random.Random(seed)
    recorders = [
        Recorder(client, [rng.randrange(4, 700) for _ in range(rng.randrange(12, 40))], max_tokens)
        for _ in range(count)
    ]
    for r in recorders:
        r.start()
    return recorders


def wait_for_tokens(recorders: list[Recorder], at_least: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while min(len(r.tokens) for r in recorders) < at_least:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.002)


def assert_exact(recorders: list[Recorder], reference) -> None:
    for r in recorders:
        assert r.error is None, f"{r.error.code()}: {r.error.details()}"
        want = hf_greedy(reference, r.prompt_ids, r.max_tokens)
        assert r.tokens == want, f"prompt of {len(r.prompt_ids)} tokens"
        assert r.finish_reason == ("length" if len(want) == r.max_tokens else "stop")


def assert_idle_and_clean(client: SchedulerClient) -> None:
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def full_log(proc: ServiceProcess) -> str:
    return proc.log_path.read_text(errors="replace")


def health_status(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def queue_is(client: SchedulerClient, running: int, waiting: int) -> bool:
    stats = client.stats()
    return (stats.running, stats.waiting) == (running, waiting)


# ---- worker failure -----------------------------------------------------------
def test_worker_killed_mid_stream_and_restarted_streams_continue_exact(worker, reference):
    with scheduler_of(MODEL, [worker], "--worker-timeout-s", "60", "--health-interval-s", "0.2") as (proc, client):
        recorders = start_streams(client, count=4, max_tokens=160, seed=1)
        wait_for_tokens(recorders, 3)
        worker.kill()
        at_kill = [len(r.tokens) for r in recorders]
        time.sleep(0.3)
        assert [len(r.tokens) for r in recorders] == at_kill, "tokens streamed with the worker dead"
        worker.restart()  # same port, new instance id, empty cache
        join(recorders)
        assert_exact(recorders, reference)
        assert all(0 < n < 160 for n in at_kill), at_kill  # every stream was cut mid-way
        assert "worker restarted: prefix cache reset" in full_log(proc)
        assert_idle_and_clean(client)


def test_idle_scheduler_notices_a_restarted_worker(worker, reference):
    prompt = list(range(100, 164))  # 4 full blocks: cached after the first request
    with scheduler_of(MODEL, [worker], "--health-interval-s", "0.2") as (proc, client):
        first = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0)
        assert client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0).cached_prompt_tokens == 48
        worker.kill()
        worker.restart()
        # No request is sent: the health watch alone must notice the new instance.
        wait_for(lambda: "worker restarted: prefix cache reset" in full_log(proc), 10, "the restart to be noticed")
        again = client.generate(prompt_token_ids=prompt, max_tokens=8, temperature=0.0)
        assert again.token_ids == first.token_ids == hf_greedy(reference, prompt, 8)
        assert again.cached_prompt_tokens == 0  # the old instance's cache was forgotten
        assert_idle_and_clean(client)


def test_two_workers_failover_moves_streams_to_the_survivor(worker, reference):
    with ServiceProcess("worker_svc", WORKER_ARGS) as second:
        with scheduler_of(MODEL, [worker, second], "--worker-timeout-s", "60") as (proc, client):
            recorders = start_streams(client, count=4, max_tokens=160, seed=2)
            wait_for_tokens(recorders, 3)
            second.kill()  # not restarted: its streams must move to `worker`
            join(recorders)
            assert_exact(recorders, reference)
            log = full_log(proc)
            moved = re.search(r"requests moved off a lost worker.*?moved=(\d+)", log)
            assert moved and int(moved.group(1)) >= 1, log[-3000:]
            assert health_status(proc.address) == health_pb2.HealthCheckResponse.SERVING
            assert client.generate("after failover", max_tokens=4, temperature=0.0).completion_tokens > 0
            assert_idle_and_clean(client)


def test_failover_under_speculative_decoding_keeps_every_stream_exact(worker, reference):
    """Drafting requests on a worker that dies move to the survivor (their drafts'
    blocks with them: the pool ends empty) and still get transformers' tokens."""
    with ServiceProcess("worker_svc", WORKER_ARGS) as second:
        # Round robin: the prompts share a prefix, which prefix routing would send to one worker.
        flags = ["--worker-timeout-s", "60", "--routing", "round-robin", *SPEC_FLAGS]
        with scheduler_of(MODEL, [worker, second], *flags) as (proc, client):
            # A run of token 171: the tiny Llama then alternates 468, 171, so the lookup drafts
            # and the model accepts (tests/integration/test_spec_serving.py).
            recorders = [Recorder(client, [171] * 21 + [5 + i], 300) for i in range(4)]
            for r in recorders:
                r.start()
            wait_for_tokens(recorders, 3)
            second.kill()
            join(recorders)
            assert_exact(recorders, reference)
            moved = re.search(r"requests moved off a lost worker.*?moved=(\d+)", full_log(proc))
            assert moved and int(moved.group(1)) >= 1, full_log(proc)[-3000:]
            stats = client.stats()
            assert stats.spec_decode_accepted_tokens > 0, stats
            assert_idle_and_clean(client)


def test_worker_not_back_within_timeout_ends_streams_unavailable_then_recovers(worker, reference):
    with scheduler_of(MODEL, [worker], "--worker-timeout-s", "1.5", "--health-interval-s", "0.2") as (proc, client):
        recorders = start_streams(client, count=2, max_tokens=240, seed=3)
        wait_for_tokens(recorders, 3)
        killed_at = time.monotonic()
        worker.kill()
        join(recorders, timeout_s=20)
        for r in recorders:
            assert r.error is not None and r.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "did not come back within 1.5s" in r.error.details()
            assert 1.5 <= r.ended_at - killed_at < 6
        wait_for(
            lambda: health_status(proc.address) == health_pb2.HealthCheckResponse.NOT_SERVING,
            5,
            "health NOT_SERVING with no worker",
        )
        with pytest.raises(grpc.RpcError) as err:
            client.generate("no worker", max_tokens=2, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        worker.restart()
        wait_for(
            lambda: health_status(proc.address) == health_pb2.HealthCheckResponse.SERVING,
            15,
            "the scheduler to reconnect",
        )
        prompt = list(range(200, 230))
        assert client.generate(prompt_token_ids=prompt, max_tokens=12, temperature=0.0).token_ids == hf_greedy(
            reference, prompt, 12
        )
        assert proc.proc.poll() is None
        assert_idle_and_clean(client)


# ---- graceful shutdown --------------------------------------------------------
def test_scheduler_sigterm_drains_running_and_queued_requests_then_exits_0(worker, reference):
    with scheduler_of(MODEL, [worker], "--max-num-seqs", "2", "--drain-timeout-s", "60") as (proc, client):
        recorders = start_streams(client, count=4, max_tokens=120, seed=4)  # two run, two queue
        wait_for(lambda: queue_is(client, running=2, waiting=2), 30, "two streams running and two queued")
        proc.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: health_status(proc.address) == health_pb2.HealthCheckResponse.NOT_SERVING, 5, "health NOT_SERVING"
        )
        with pytest.raises(grpc.RpcError) as err:
            client.generate("too late", max_tokens=2, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
        assert any(not r.finish_reason for r in recorders), "the drain had nothing left to finish"
        join(recorders)
        assert proc.proc.wait(30) == 0
        assert_exact(recorders, reference)
        log = full_log(proc)
        assert "engine audit clean" in log and "drain cut short" not in log


def test_scheduler_sigterm_past_drain_timeout_ends_streams_unavailable(worker):
    with scheduler_of(MODEL, [worker], "--max-num-seqs", "1", "--drain-timeout-s", "0.5") as (proc, client):
        recorders = start_streams(client, count=2, max_tokens=450, seed=5)
        wait_for(lambda: queue_is(client, running=1, waiting=1), 30, "one stream running and one queued")
        signalled = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        join(recorders, timeout_s=30)
        assert proc.proc.wait(30) == 0
        for r in recorders:
            assert r.error is not None and r.error.code() == grpc.StatusCode.UNAVAILABLE, r.finish_reason
            assert "shut down" in r.error.details()
            assert r.ended_at - signalled < 5
        assert "engine audit clean" in full_log(proc)


def test_worker_sigterm_finishes_the_step_in_flight(worker):
    seqs = [
        seq_step(i, [(i * 7 + j) % 700 + 4 for j in range(400)], 0, list(range(i * 25, (i + 1) * 25)), logits=False)
        for i in range(128)
    ]  # 51k tokens: ~1-2 s for the tiny model on 2 cores
    limit = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    with grpc.insecure_channel(worker.address, options=limit) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stub.Info(worker_pb2.InfoRequest(), timeout=10)
        future = stub.Step.future(step_request(7, seqs), timeout=60)
        time.sleep(0.1)
        assert not future.done(), "the step finished before SIGTERM; make it bigger"
        worker.proc.send_signal(signal.SIGTERM)
        reply = future.result()
        assert reply.step_id == 7 and len(sampled_rows(reply)) == 128
        assert worker.proc.wait(30) == 0
        with pytest.raises(grpc.RpcError) as err:
            stub.Info(worker_pb2.InfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker stopped" in full_log(worker)
