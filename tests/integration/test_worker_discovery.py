"""Workers found through DNS (--workers dns:///NAME:PORT), with real worker processes
(tiny llama, float32) and every greedy stream checked against transformers:

* the scheduler's engine in this process, following a stub resolver whose answer
  the test changes: a worker that appears joins and takes requests; one that
  disappears mid-stream is drained (its requests finish there, then it is
  forgotten); one that is killed hands its requests over to the other, and
  leaving DNS afterwards removes it. Discovery rounds are driven by the test.
* a scheduler process resolving `localhost` with the real resolver.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import grpc
import pytest

from proto import admin_pb2, admin_pb2_grpc, serving_pb2, serving_pb2_grpc
from scheduler_svc.api.server import start_server
from scheduler_svc.client import SchedulerClient
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.discovery import WorkerDiscovery
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import hf_greedy, load_model, wait_idle
from tests.helpers.fake_worker_server import audit_engine
from tests.helpers.procs import ServiceProcess, running
from tests.helpers.stub_dns import StubDns

MODEL = tiny_checkpoint("llama")
WORKER_ARGS = ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "512"]
TARGET = "dns:///workers.test:50061"


@pytest.fixture(scope="module")
def reference():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def workers():
    with running([ServiceProcess("worker_svc", WORKER_ARGS) for _ in range(2)]) as procs:
        yield procs


@dataclass
class Stream:
    prompt_ids: list[int]
    max_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""


async def run_stream(stub, stream: Stream) -> Stream:
    request = serving_pb2.GenerateRequest(
        prompt_token_ids=stream.prompt_ids, max_tokens=stream.max_tokens, temperature=0
    )
    async for reply in stub.Generate(request, timeout=120):
        stream.tokens.extend(reply.token_ids)
        stream.finish_reason = reply.finish_reason or stream.finish_reason
    return stream


def start_streams(stub, count: int, max_tokens: int, seed: int) -> list[asyncio.Task[Stream]]:
    rng = random.Random(seed)
    return [
        asyncio.create_task(
            run_stream(stub, Stream([rng.randrange(4, 700) for _ in range(rng.randrange(12, 40))], max_tokens))
        )
        for _ in range(count)
    ]


def assert_exact(streams: list[Stream], reference) -> None:
    for s in streams:
        want = hf_greedy(reference, s.prompt_ids, s.max_tokens)
        assert s.tokens == want and s.finish_reason == ("length" if len(want) == s.max_tokens else "stop")


def status(engine, address: str):
    return next((w for w in engine.fleet.list_workers() if w.address == address), None)


async def until(predicate) -> None:
    while not predicate():  # bounded by the scenario's wait_for
        await asyncio.sleep(0.01)


def test_workers_join_drain_and_fail_over_as_dns_changes(workers, reference):
    w0, w1 = (w.address for w in workers)
    tokenizer = load_tokenizer(MODEL)
    dns = StubDns(w0)
    config = SchedulerConfig(
        workers=TARGET,
        model=str(MODEL),
        max_num_seqs=2,  # queues build up, so there is work in flight when the answer changes
        health_interval_s=0.2,
        worker_timeout_s=60,
    )

    async def scenario(engine, discovery, stub):
        assert [w.address for w in engine.fleet.list_workers()] == [w0]
        first = start_streams(stub, 6, 32, seed=1)
        await until(lambda: status(engine, w0).running > 0)

        # w1 appears: it joins in this round and takes new requests (it is cold and idle).
        dns.answer = [w0, w1]
        await discovery.reconcile()
        assert status(engine, w1).state is WorkerState.SERVING
        second = start_streams(stub, 4, 32, seed=2)
        await until(lambda: status(engine, w1).requests_routed > 0)

        # w0 disappears while it runs requests: drained, they finish there, then it is forgotten.
        dns.answer = [w1]
        await discovery.reconcile()
        draining = status(engine, w0)
        assert draining.state is WorkerState.DRAINING and draining.running + draining.waiting > 0
        third = start_streams(stub, 2, 16, seed=3)  # none of these may go to w0
        await until(lambda: status(engine, w0) is None)
        streams = await asyncio.gather(*first, *second, *third)
        assert_exact(streams, reference)
        assert status(engine, w1).requests_routed == len(streams) - draining.requests_routed

        # w0 back; then w1 is killed mid-stream: its requests move to w0 and finish exactly;
        # once w1 leaves DNS it is drained and forgotten.
        dns.answer = [w0, w1]
        await discovery.reconcile()
        assert status(engine, w0).state is WorkerState.SERVING and status(engine, w0).requests_routed == 0
        fourth = start_streams(stub, 6, 48, seed=4)
        await until(lambda: status(engine, w1).running > 0 and status(engine, w0).running > 0)
        lost = next(c for c in engine.cores if c.info.address == w1)
        await asyncio.to_thread(workers[1].kill)
        await until(lambda: lost.counters.requests_moved_out > 0)
        dns.answer = [w0]
        await discovery.reconcile()
        assert status(engine, w1) is None or status(engine, w1).state is WorkerState.DRAINING
        assert_exact(await asyncio.gather(*fourth), reference)
        await until(lambda: status(engine, w1) is None)
        assert [w.address for w in engine.fleet.list_workers()] == [w0]

    async def main():
        engine = await Engine.connect(config, tokenizer, resolver=dns)
        discovery = WorkerDiscovery(
            engine.fleet, config.worker_targets, config.worker_discovery_interval_s, resolver=dns
        )
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await asyncio.wait_for(scenario(engine, discovery, serving_pb2_grpc.SchedulerStub(channel)), 240)
        finally:
            await server.stop(None)
            await engine.stop()
        audit_engine(engine)  # no block held anywhere
        assert set(dns.queries) == {("workers.test", 50061)}

    try:
        asyncio.run(main())
    finally:
        if workers[1].proc.poll() is not None:
            workers[1].restart()


def test_scheduler_resolves_localhost_with_the_real_resolver(workers, reference):
    worker = workers[0]
    args = ["--model", str(MODEL), "--workers", f"dns:///localhost:{worker.port}", "--admin-port", "0"]
    args += ["--worker-discovery-interval-s", "1"]  # were localhost also ::1 (unserved), start-up tries it 1 s
    with ServiceProcess("scheduler_svc", args) as proc, SchedulerClient(proc.address) as client:
        with grpc.insecure_channel(proc.admin_address) as channel:
            listed = admin_pb2_grpc.AdminStub(channel).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        assert [w.address for w in listed.workers] == [f"127.0.0.1:{worker.port}"]
        ids = [5, 17, 99, 123, 42, 7, 300, 11]
        got = client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, timeout=60)
        assert got.token_ids == hf_greedy(reference, ids, 8)
        assert wait_idle(client).blocks_used == 0
