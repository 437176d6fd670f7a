"""How a worker answers a step that fails on its device (issue 27, fault 2),
through the real worker process: a CUDA error that kills the device context
(an illegal address, a device-side assert) turns health NOT_SERVING, answers
UNAVAILABLE and exits non-zero, so the scheduler fails over instead of sending
steps to a worker that fails them all; running out of memory fails only that
step (RESOURCE_EXHAUSTED) and the worker serves on. The log says which. The
fault is injected into the model runner (tests/helpers/faulty_worker.py)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import worker_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import seq_step, step_request

SERVICE = "worker.v1.Worker"


def _worker(fault: str) -> ServiceProcess:
    args = ["--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "16"]
    return ServiceProcess("tests.helpers.faulty_worker", args, env={"PAGEDSERVE_TEST_FAULT": fault}).start()


def _step(step_id: int):
    return step_request(step_id, [seq_step(1, [5, 6, 7], 0, [0, 1])])


def test_a_cuda_error_takes_the_worker_down():
    worker = _worker("cuda")
    try:
        channel = grpc.insecure_channel(worker.address)
        statuses: list[int] = []
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))

        def follow() -> None:
            try:
                for reply in watch:
                    statuses.append(reply.status)
            except grpc.RpcError:
                pass  # the server went away

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        deadline = time.monotonic() + 10
        while not statuses and time.monotonic() < deadline:
            time.sleep(0.05)
        assert statuses == [health_pb2.HealthCheckResponse.SERVING]
        with pytest.raises(grpc.RpcError) as failed:
            worker_pb2_grpc.WorkerStub(channel).Step(_step(1), timeout=30)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "illegal memory access" in failed.value.details()
        assert worker.proc is not None
        assert worker.proc.wait(timeout=30) == 1
        follower.join(10)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        log = worker.log_path.read_text()
        assert "device lost" in log and "worker down" in log
        channel.close()
    finally:
        worker.stop()


def test_out_of_memory_fails_the_step_only():
    worker = _worker("oom")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.RpcError) as failed:
                stub.Step(_step(1), timeout=30)
            assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "out of memory" in failed.value.details()
            reply = stub.Step(_step(2), timeout=30)  # the worker serves on
            assert len(reply.sampled.token_ids) == 1
            check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        assert worker.proc is not None and worker.proc.poll() is None
        assert "ran out of device memory" in worker.log_path.read_text()
    finally:
        worker.stop()
