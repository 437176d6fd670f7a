"""worker.v1 StepStream against a real worker process: steps run in order with the
results a unary Step call gives, a refused step is answered with Step's status code
and details and the stream goes on, and a worker going down ends its open streams at
once (its shutdown is not held for the grace)."""

from __future__ import annotations

import queue
import signal
import time

import grpc
import pytest

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import by_seq, logits_of, seq_step, step_request

NUM_BLOCKS = 32
WORKER_ARGS = ["--dtype", "float32", "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "256"]


def worker_process(*extra: str) -> ServiceProcess:
    return ServiceProcess("worker_svc", ["--model", str(tiny_checkpoint("llama")), *WORKER_ARGS, *extra])


class Requests:
    """A stream's requests, handed over one at a time by the test."""

    def __init__(self) -> None:
        self._queue: queue.Queue[worker_pb2.StepRequest | None] = queue.Queue()

    def send(self, request: worker_pb2.StepRequest) -> None:
        self._queue.put(request)

    def end(self) -> None:
        self._queue.put(None)

    def __iter__(self):
        while (request := self._queue.get()) is not None:
            yield request


@pytest.fixture(scope="module")
def stub():
    with worker_process() as proc, grpc.insecure_channel(proc.address) as channel:
        yield worker_pb2_grpc.WorkerStub(channel)


def test_steps_on_a_stream_answer_as_unary_calls_and_a_refusal_does_not_end_it(stub):
    prompt = list(range(10, 30))
    unary_first = by_seq(stub.Step(step_request(1, [seq_step(1, prompt, 0, [1, 2])])))[1]

    requests = Requests()
    replies = stub.StepStream(iter(requests))
    requests.send(step_request(2, [seq_step(2, prompt, 0, [3, 4])]))
    first = next(replies)
    assert first.WhichOneof("outcome") == "response"
    streamed_first = by_seq(first.response)[2]
    assert streamed_first.token_id == unary_first.token_id
    assert logits_of(streamed_first).tolist() == logits_of(unary_first).tolist()

    requests.send(step_request(3, [seq_step(3, [5], 0, [NUM_BLOCKS])]))  # a block outside the pool
    refused = next(replies)
    assert refused.WhichOneof("outcome") == "refusal"
    assert refused.refusal.code == grpc.StatusCode.INVALID_ARGUMENT.name
    assert "seqs.block_tables[row 0]" in refused.refusal.details

    # the stream goes on: the decode after the first step, on the same blocks
    requests.send(step_request(4, [seq_step(2, [streamed_first.token_id], 20, [3, 4])]))
    decoded = next(replies)
    assert decoded.WhichOneof("outcome") == "response" and decoded.response.step_id == 4
    unary_decode = by_seq(stub.Step(step_request(5, [seq_step(1, [unary_first.token_id], 20, [1, 2])])))[1]
    assert by_seq(decoded.response)[2].token_id == unary_decode.token_id
    requests.end()
    assert list(replies) == []  # ended by the worker once the scheduler is done writing


def test_a_worker_going_down_ends_its_open_streams_at_once():
    with worker_process("--drain-timeout-s", "60") as proc, grpc.insecure_channel(proc.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        requests = Requests()
        replies = stub.StepStream(iter(requests))
        requests.send(step_request(1, [seq_step(1, list(range(10, 30)), 0, [1, 2])]))
        assert next(replies).WhichOneof("outcome") == "response"

        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert list(replies) == []  # ended by the worker: the scheduler fails what it still waits for
        assert proc.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 20, "the open stream held the shutdown for its grace"


def test_replies_come_in_the_order_of_the_steps(stub):
    requests = Requests()
    for i in range(4):  # all sent before any reply is read
        requests.send(step_request(10 + i, [seq_step(20 + i, list(range(10 + i, 20 + i)), 0, [10 + i])]))
    requests.end()
    assert [r.response.step_id for r in stub.StepStream(iter(requests))] == [10, 11, 12, 13]
