"""What an exception out of a step means for the worker: the step alone failed,
or the device can run nothing any more."""

from __future__ import annotations

import torch

OUT_OF_MEMORY, DEVICE_LOST, STEP_FAILED = "out of memory", "device lost", "step failed"
# Errors after which a CUDA context is unusable: they are sticky, every later launch
# fails the same way (torch's and Triton's launchers, cuBLAS, cuDNN, NCCL).
_DEVICE_LOST_MARKERS = (
    "CUDA error",
    "CUDA_ERROR",
    "Triton Error [CUDA]",
    "device-side assert",
    "illegal memory access",
    "illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "NCCL error",
)
# Allocation failures (the caching allocator's, a library's workspace): a smaller step may fit.
_OUT_OF_MEMORY_MARKERS = ("out of memory", "ALLOC_FAILED")


def classify_failure(exc: BaseException) -> str:
    """OUT_OF_MEMORY (recoverable: the step is refused, the worker serves on),
    DEVICE_LOST (fatal: an illegal address or a device-side assert leaves the CUDA
    context dead, so every later step would fail while the worker looked healthy)
    or STEP_FAILED (anything else: this step's bug, the worker serves on)."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError) or any(m in text for m in _OUT_OF_MEMORY_MARKERS):
        return OUT_OF_MEMORY
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    if (accelerator_error is not None and isinstance(exc, accelerator_error)) or any(
        m in text for m in _DEVICE_LOST_MARKERS
    ):
        return DEVICE_LOST
    return STEP_FAILED
