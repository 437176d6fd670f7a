"""The worker's device (issue 27, faults 1 and 2), through fakes on a CPU machine:
the CUDA device is made current at start-up and on the thread of every step
(gRPC pool threads and tensor-parallel ranks start on GPU 0, where Triton would
launch with pointers into GPU N), and a step's exception is told apart: CUDA
errors that kill the context are fatal, out-of-memory and the rest are not."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.worker_steps import Seq, step_input
from worker_svc.config import WorkerConfig
from worker_svc.step.errors import StepOutOfMemory, WorkerDown
from worker_svc.worker import (
    DEVICE_LOST,
    OUT_OF_MEMORY,
    STEP_FAILED,
    Worker,
    classify_failure,
    use_device,
)
from worker_svc.worker import core as worker_module


class FakeCuda:
    """torch.cuda.set_device with a current device per thread, as CUDA keeps it."""

    def __init__(self, monkeypatch):
        self.current = threading.local()
        self.calls: list[tuple[str, torch.device]] = []
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device) -> None:
        device = torch.device(device)
        self.current.device = device
        self.calls.append((threading.current_thread().name, device))

    def device_here(self) -> torch.device:
        return getattr(self.current, "device", torch.device("cuda", 0))


@pytest.fixture(scope="module")
def cpu_worker() -> Worker:
    return Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=8))


def _step(step_id: int):
    return step_input(step_id, [], [Seq(1, [5, 6, 7], 0, [0], [0, 1, 2], sample=True)])


def test_use_device_makes_a_cuda_device_current_and_leaves_cpu_alone(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    use_device(torch.device("cpu"))
    assert cuda.calls == []
    use_device(torch.device("cuda", 1))
    assert cuda.device_here() == torch.device("cuda", 1)


@pytest.mark.parametrize("entry", ["step", "execute"])  # execute: what a tensor-parallel rank runs
def test_every_step_runs_with_the_workers_device_current_on_its_thread(cpu_worker, monkeypatch, entry):
    """A worker on cuda:1 (faked: its device says so, its runner records what the
    thread running the step has current): each step, on a fresh thread as gRPC
    would run it, sees cuda:1, not the thread's default GPU 0."""
    cuda = FakeCuda(monkeypatch)
    seen: list[torch.device] = []
    real_execute = cpu_worker.runner.execute
    monkeypatch.setattr(cpu_worker, "device", torch.device("cuda", 1))
    monkeypatch.setattr(
        cpu_worker.runner, "execute", lambda step: seen.append(cuda.device_here()) or real_execute(step)
    )
    for step_id in (1, 2):
        thread = threading.Thread(target=getattr(cpu_worker, entry), args=(_step(step_id),), name=f"grpc-{step_id}")
        thread.start()
        thread.join()
    assert seen == [torch.device("cuda", 1)] * 2
    assert [name for name, _ in cuda.calls] == ["grpc-1", "grpc-2"]


def test_the_worker_makes_its_device_current_at_start_up(monkeypatch):
    """Worker() calls use_device with the device it resolved, before loading (the
    model, the cache and the warm-up's graphs go where the current device is)."""
    calls: list[torch.device] = []
    real_load = worker_module.DecoderModel.load

    def load(*args, **kwargs):
        assert calls, "the model loads before the device is made current"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(worker_module, "use_device", calls.append)
    monkeypatch.setattr(worker_module.DecoderModel, "load", load)
    Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=8))
    assert calls == [torch.device("cpu")]


@pytest.mark.parametrize(
    "exc,kind",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OUT_OF_MEMORY),
        (RuntimeError("CUDA error: out of memory"), OUT_OF_MEMORY),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), OUT_OF_MEMORY),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), DEVICE_LOST),
        (RuntimeError("CUDA error: device-side assert triggered"), DEVICE_LOST),
        (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), DEVICE_LOST),
        (RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx(...)`"), DEVICE_LOST),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error"), DEVICE_LOST),
        (ValueError("shapes do not match"), STEP_FAILED),
        (RuntimeError("expected scalar type Float but found BFloat16"), STEP_FAILED),
    ],
)
def test_failures_are_classified(exc, kind):
    assert classify_failure(exc) == kind


def test_accelerator_errors_are_fatal():
    error = getattr(torch, "AcceleratorError", None)
    if error is None:
        pytest.skip("this torch has no AcceleratorError")
    assert classify_failure(error.__new__(error)) == DEVICE_LOST


def test_a_dead_device_fails_the_worker_and_every_later_step(monkeypatch):
    worker = Worker(WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=8))
    failures: list[str] = []
    worker.on_failure(lambda: failures.append("down"))

    def lost(step):
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(worker.runner, "execute", lost)
    with pytest.raises(WorkerDown, match="device-side assert"):
        worker.step(_step(1))
    assert failures == ["down"] and worker.failed is not None
    monkeypatch.undo()
    with pytest.raises(WorkerDown):  # nothing runs on a dead context any more
        worker.step(_step(2))


def test_out_of_memory_fails_the_step_only(cpu_worker, monkeypatch):
    real_execute = cpu_worker.runner.execute

    def oom(step):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cpu_worker.runner, "execute", oom)
    with pytest.raises(StepOutOfMemory):
        cpu_worker.step(_step(10))
    monkeypatch.setattr(cpu_worker.runner, "execute", real_execute)
    assert cpu_worker.failed is None
    assert len(cpu_worker.step(_step(11)).samples.token_ids) == 1
