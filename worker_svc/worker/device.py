"""Where a worker computes: its device (made current on every thread that launches
on it), the dtypes its flags name, and its torch threads."""

from __future__ import annotations

import structlog
import torch

from svc_common.cpu_features import CpuFeatures, ThreadPlan, thread_plan
from worker_svc.config import WorkerConfig
from worker_svc.step.input import StepInput

log = structlog.get_logger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TORCH_DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
# FP8 e4m3 needs Ada / Hopper or newer: native e4m3 conversions, and Triton's
# fp8e4nv type, start at compute capability 8.9.
FP8_MIN_CUDA_CAPABILITY = (8, 9)


def resolve_kv_dtype(requested: str, weights_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache dtype actually used for --kv-dtype `requested`.

    * auto: the weights' dtype.
    * fp8 on a CUDA device below compute capability 8.9 (e.g. A100, sm_80):
      INT8 instead, with one warning; the worker serves on.
    * fp8 on CPU: kept. CPU torch stores float8_e4m3fn and converts to and from it
      in software (round to nearest even, as the GPU's conversion), and the Triton
      interpreter reads it, so FP8 is emulated exactly, only slower than a native
      cast; quality measured on CPU is FP8's.
    """
    if requested == "auto":
        return weights_dtype
    dtype = KV_TORCH_DTYPES[requested]
    if dtype == torch.float8_e4m3fn and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CUDA_CAPABILITY:
            log.warning(
                "kv cache fp8 not supported on this device: falling back to int8",
                requested="fp8",
                kv_dtype="int8",
                device=describe(device),
                compute_capability=f"{capability[0]}.{capability[1]}",
                needs=f"{FP8_MIN_CUDA_CAPABILITY[0]}.{FP8_MIN_CUDA_CAPABILITY[1]}",
            )
            return torch.int8
    return dtype


def resolve_device(name: str) -> torch.device:
    """--device as a torch device; a bare `cuda` is the current CUDA device (0)."""
    device = torch.device(name)
    if device.type == "cuda" and ":" not in name:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def use_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device. Tensors carry their
    device, but Triton launches, CUDA events, streams and graph capture go to the
    thread's current device, and every thread starts on device 0: gRPC runs each
    step on a pool thread, so a worker on cuda:1 would launch its kernels on GPU 0
    with pointers into GPU 1. Called at start-up and at the start of every step."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def set_threads(config: WorkerConfig, cpu: CpuFeatures) -> tuple[str, ThreadPlan | None]:
    """Sets this process's torch threads from --num-threads (0: the CPU thread plan,
    returned: it picks each step's threads); says why. Tensor-parallel ranks share
    the worker's threads out (parallel/group.py)."""
    if config.tensor_parallel_size > 1:
        return "shared out over the tensor-parallel ranks", None
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
        return "--num-threads", None
    if not config.device.startswith("cpu"):
        return "torch's default (a GPU worker)", None
    plan = thread_plan(cpu.cores)
    torch.set_num_threads(plan.worker_threads)
    return plan.reason, plan


def use_threads(plan: ThreadPlan, step: StepInput) -> None:
    """The step's torch threads by its size (svc_common/cpu_features.py says why)."""
    threads = plan.threads_for(len(step.seqs.token_ids))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
