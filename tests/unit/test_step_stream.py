"""The scheduler's StepStream (scheduler_svc/engine/step_stream.py) against a scripted
worker over real gRPC: replies matched to steps in order, a refused step failing alone
with its code while the stream goes on, a broken stream failing every step still
unanswered, and an abandoned step's reply dropped without shifting the others."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.engine.errors import WorkerCallFailed
from scheduler_svc.engine.step_stream import StepStream
from scheduler_svc.engine.worker_client import WorkerClient
from scheduler_svc.planning.plan import StepPlan

REFUSAL = "seqs.token_ids[row 0]: 99999 is not below the vocabulary size"


class ScriptedWorker(worker_pb2_grpc.WorkerServicer):
    """Answers each step by its id: "ok", "refuse" (INVALID_ARGUMENT), "abort" (the
    stream ends UNAVAILABLE) or "slow" (ok after 0.3 s)."""

    def __init__(self, script: dict[int, str]):
        self.script = script
        self.seen: list[int] = []

    async def StepStream(self, request_iterator, context):
        async for request in request_iterator:
            self.seen.append(request.step_id)
            action = self.script.get(request.step_id, "ok")
            if action == "abort":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker gone")
            if action == "slow":
                await asyncio.sleep(0.3)
            if action == "refuse":
                refusal = worker_pb2.StepRefusal(code="INVALID_ARGUMENT", details=REFUSAL)
                yield worker_pb2.StepReply(refusal=refusal)
            else:
                # the step's id as its forward time: StepResult carries no id, so this tells replies apart
                timings = worker_pb2.StepTimings(forward_ms=request.step_id)
                response = worker_pb2.StepResponse(step_id=request.step_id, instance_id="w", timings=timings)
                yield worker_pb2.StepReply(response=response)


async def with_stream(script: dict[int, str], body) -> ScriptedWorker:
    server = grpc.aio.server()
    worker = ScriptedWorker(script)
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        stream = StepStream(client)
        await body(stream)
        await stream.close()
    finally:
        await client.close()
        await server.stop(None)
    return worker


def steps(stream: StepStream, ids: list[int]) -> list[asyncio.Task]:
    return [asyncio.create_task(stream.step(StepPlan(step_id=i))) for i in ids]


def test_a_refused_step_fails_alone_and_the_stream_goes_on():
    async def body(stream):
        results = await asyncio.gather(*steps(stream, [1, 2, 3]), return_exceptions=True)
        assert [r.forward_ms for r in (results[0], results[2])] == [1, 3]
        refused = results[1]
        assert isinstance(refused, WorkerCallFailed)
        assert (refused.transient, refused.reason, refused.details) == (False, "INVALID_ARGUMENT", REFUSAL)
        assert (await stream.step(StepPlan(step_id=4))).forward_ms == 4

    worker = asyncio.run(with_stream({2: "refuse"}, body))
    assert worker.seen == [1, 2, 3, 4]


def test_a_broken_stream_fails_every_step_unanswered():
    async def body(stream):
        assert (await stream.step(StepPlan(step_id=1))).forward_ms == 1  # answered before the stream breaks
        failures = await asyncio.gather(*steps(stream, [2, 3]), return_exceptions=True)
        assert all(isinstance(f, WorkerCallFailed) for f in failures), failures
        # the status the stream ended with: the abort's UNAVAILABLE (grpc.aio's server may
        # report an abort racing a pending read as INTERNAL), the same for every step
        ended = {(f.transient, f.reason) for f in failures}
        assert ended in ({(True, "UNAVAILABLE")}, {(False, "INTERNAL")}), ended
        with pytest.raises(WorkerCallFailed) as later:  # the stream is over: a later step fails at once
            await stream.step(StepPlan(step_id=4))
        assert {(later.value.transient, later.value.reason)} == ended

    asyncio.run(with_stream({2: "abort"}, body))


def test_an_abandoned_steps_reply_is_dropped_and_the_next_gets_its_own():
    async def body(stream):
        abandoned, kept = steps(stream, [1, 2])
        await asyncio.sleep(0.05)  # both sent; step 1 is still running
        abandoned.cancel()
        assert (await kept).forward_ms == 2

    worker = asyncio.run(with_stream({1: "slow"}, body))
    assert worker.seen == [1, 2]
