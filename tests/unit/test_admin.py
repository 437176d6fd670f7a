"""admin.v1 servicer over a real gRPC server on 127.0.0.1, against a fake engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import admin_pb2, admin_pb2_grpc
from scheduler_svc.api.admin import start_admin_server
from scheduler_svc.engine.errors import LastWorker, UnknownWorker, WorkerExists, WorkerIncompatible, WorkerUnreachable
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.engine.worker_status import WorkerStatus
from svc_common.addresses import host_port_problem as check_address


class FakeEngine:
    """The AdminEngine interface with the engine's semantics, minus the workers."""

    routing = "prefix"

    def __init__(self, addresses=("127.0.0.1:50061",)):
        self.workers: dict[str, dict] = {a: {"state": WorkerState.SERVING, "running": 0} for a in addresses}
        self.removed: dict[str, asyncio.Event] = {}
        self.unreachable: set[str] = set()
        self.incompatible: set[str] = set()
        self.explode = False

    def status(self, address: str, state: WorkerState | None = None) -> WorkerStatus:
        w = self.workers.get(address, {"state": WorkerState.REMOVED, "running": 0})
        return WorkerStatus(
            address=address,
            state=state or w["state"],
            running=w["running"],
            blocks_total=64,
            blocks_free=64 - w["running"],
            blocks_used=w["running"],
            prefix_hit_tokens=32,
            prompt_tokens=100,
            requests_routed=5,
            requests_finished=4,
            model="m",
            device="cpu",
            kv_dtype="bf16",
        )

    async def add_worker(self, address: str) -> WorkerStatus:
        if self.explode:
            raise RuntimeError("secret internals")
        if address in self.workers:
            raise WorkerExists(f"worker {address} is already known")
        if address in self.unreachable:
            raise WorkerUnreachable(f"worker {address} did not answer Info within 1s")
        if address in self.incompatible:
            raise WorkerIncompatible(f"worker {address} serves another model")
        self.workers[address] = {"state": WorkerState.SERVING, "running": 0}
        return self.status(address)

    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus:
        if address not in self.workers:
            raise UnknownWorker(f"no worker {address}")
        serving = [a for a, w in self.workers.items() if w["state"] is WorkerState.SERVING]
        if serving == [address] and not allow_last:
            raise LastWorker(f"{address} is the last serving worker; pass allow_last to drain it")
        self.workers[address]["state"] = WorkerState.DRAINING
        done = self.removed.setdefault(address, asyncio.Event())
        if self.workers[address]["running"] == 0:
            self._remove(address)
        if not wait:
            return self.status(address)
        await done.wait()
        return self.status(address, WorkerState.REMOVED)

    def finish_all(self, address: str) -> None:
        self.workers[address]["running"] = 0
        self._remove(address)

    def _remove(self, address: str) -> None:
        del self.workers[address]
        self.removed[address].set()

    def list_workers(self) -> list[WorkerStatus]:
        return [self.status(a) for a in self.workers]


def run(engine: FakeEngine, scenario) -> None:
    async def main():
        server, port = await start_admin_server(engine, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await scenario(admin_pb2_grpc.AdminStub(channel), channel)
        finally:
            await server.stop(None)

    asyncio.run(main())


async def expect_error(call, code: grpc.StatusCode, match: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value
    assert match in info.value.details()
    return info.value.details()


def test_add_list_and_errors():
    engine = FakeEngine()

    async def scenario(stub, channel):
        reply = await stub.AddWorker(admin_pb2.AddWorkerRequest(address="127.0.0.1:50062"))
        assert reply.worker.address == "127.0.0.1:50062"
        assert reply.worker.state == admin_pb2.WORKER_STATE_SERVING
        listed = await stub.ListWorkers(admin_pb2.ListWorkersRequest())
        assert [w.address for w in listed.workers] == ["127.0.0.1:50061", "127.0.0.1:50062"]
        assert listed.routing == "prefix"
        w = listed.workers[0]
        assert (
            w.blocks_total,
            w.blocks_free,
            w.prefix_hit_tokens,
            w.prompt_tokens,
            w.requests_routed,
            w.requests_finished,
            w.model,
            w.device,
            w.kv_dtype,
        ) == (64, 64, 32, 100, 5, 4, "m", "cpu", "bf16")
        await expect_error(
            stub.AddWorker(admin_pb2.AddWorkerRequest(address="127.0.0.1:50062")),
            grpc.StatusCode.ALREADY_EXISTS,
            "already known",
        )
        engine.unreachable.add("10.0.0.9:1")
        await expect_error(
            stub.AddWorker(admin_pb2.AddWorkerRequest(address="10.0.0.9:1")),
            grpc.StatusCode.UNAVAILABLE,
            "did not answer",
        )
        engine.incompatible.add("10.0.0.9:2")
        await expect_error(
            stub.AddWorker(admin_pb2.AddWorkerRequest(address="10.0.0.9:2")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "another model",
        )
        for bad in ("", "nohost", ":50061", "h:0", "h:70000", "h:p", "a:1,b:2", " h:1"):
            await expect_error(
                stub.AddWorker(admin_pb2.AddWorkerRequest(address=bad)), grpc.StatusCode.INVALID_ARGUMENT, "address"
            )
            await expect_error(
                stub.DrainWorker(admin_pb2.DrainWorkerRequest(address=bad)), grpc.StatusCode.INVALID_ARGUMENT, "address"
            )
        engine.explode = True
        details = await expect_error(
            stub.AddWorker(admin_pb2.AddWorkerRequest(address="127.0.0.1:50070")),
            grpc.StatusCode.INTERNAL,
            "add worker failed",
        )
        assert "secret" not in details and "Traceback" not in details
        # Health and the admin service name are served on the admin listener.
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "admin.v1.Admin"):
            r = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING

    run(engine, scenario)


def test_drain_waits_for_running_requests_then_removes():
    engine = FakeEngine(("127.0.0.1:50061", "127.0.0.1:50062"))
    engine.workers["127.0.0.1:50061"]["running"] = 3

    async def scenario(stub, channel):
        reply = await stub.DrainWorker(admin_pb2.DrainWorkerRequest(address="127.0.0.1:50061"))
        assert reply.worker.state == admin_pb2.WORKER_STATE_DRAINING and reply.worker.running == 3
        # Draining twice is fine; with wait it returns once the worker is gone.
        waiting = asyncio.ensure_future(
            stub.DrainWorker(admin_pb2.DrainWorkerRequest(address="127.0.0.1:50061", wait=True))
        )
        await asyncio.sleep(0.2)
        assert not waiting.done()
        listed = await stub.ListWorkers(admin_pb2.ListWorkersRequest())
        assert {w.address: w.state for w in listed.workers} == {
            "127.0.0.1:50061": admin_pb2.WORKER_STATE_DRAINING,
            "127.0.0.1:50062": admin_pb2.WORKER_STATE_SERVING,
        }
        engine.finish_all("127.0.0.1:50061")
        reply = await asyncio.wait_for(waiting, 5)
        assert reply.worker.state == admin_pb2.WORKER_STATE_REMOVED
        listed = await stub.ListWorkers(admin_pb2.ListWorkersRequest())
        assert [w.address for w in listed.workers] == ["127.0.0.1:50062"]
        await expect_error(
            stub.DrainWorker(admin_pb2.DrainWorkerRequest(address="127.0.0.1:50061")),
            grpc.StatusCode.NOT_FOUND,
            "no worker",
        )
        await expect_error(
            stub.DrainWorker(admin_pb2.DrainWorkerRequest(address="127.0.0.1:50062")),
            grpc.StatusCode.FAILED_PRECONDITION,
            "last serving worker",
        )
        reply = await stub.DrainWorker(
            admin_pb2.DrainWorkerRequest(address="127.0.0.1:50062", allow_last=True, wait=True), timeout=5
        )
        assert reply.worker.state == admin_pb2.WORKER_STATE_REMOVED

    run(engine, scenario)


def test_drain_wait_deadline_does_not_undo_the_drain():
    engine = FakeEngine(("127.0.0.1:50061", "127.0.0.1:50062"))
    engine.workers["127.0.0.1:50061"]["running"] = 1

    async def scenario(stub, channel):
        await expect_error(
            stub.DrainWorker(admin_pb2.DrainWorkerRequest(address="127.0.0.1:50061", wait=True), timeout=0.3),
            grpc.StatusCode.DEADLINE_EXCEEDED,
        )
        listed = await stub.ListWorkers(admin_pb2.ListWorkersRequest())
        assert listed.workers[0].state == admin_pb2.WORKER_STATE_DRAINING

    run(engine, scenario)


def test_worker_status_from_core():
    from scheduler_svc.kv.block_manager import KVCacheManager
    from scheduler_svc.kv.block_pool import BlockPool

    class Core:
        class info:
            address, model_name, device, kv_dtype = "h:1", "m", "cuda:0", "fp8"

        class planner:
            num_running, num_waiting = 2, 1
            kv = KVCacheManager(BlockPool(10, 16))

        class counters:
            prompt_tokens, requests_finished = 50, 7

    s = WorkerStatus.from_core(Core, WorkerState.DRAINING, prefix_hit_tokens=16, requests_routed=9)
    assert (
        s.address,
        s.state,
        s.running,
        s.waiting,
        s.blocks_total,
        s.blocks_free,
        s.prefix_hit_tokens,
        s.prompt_tokens,
        s.requests_routed,
        s.requests_finished,
        s.device,
    ) == ("h:1", WorkerState.DRAINING, 2, 1, 10, 10, 16, 50, 9, 7, "cuda:0")


def test_check_address():
    assert check_address("127.0.0.1:50061") is None
    assert check_address("[::1]:50061") is None
    assert check_address("worker-0:50061") is None
    assert check_address("worker-0") is not None
