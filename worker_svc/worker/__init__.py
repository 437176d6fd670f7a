"""The worker: the model, its paged KV cache and the step executor, built from
config (core.py); where it computes (device.py), what a failed step means
(failures.py), how big its pools are (sizing.py), what it says of itself (info.py).
The names callers use are importable from the package."""

from worker_svc.worker.core import UnsupportedModel, Worker, architectures
from worker_svc.worker.device import resolve_kv_dtype, use_device
from worker_svc.worker.failures import DEVICE_LOST, OUT_OF_MEMORY, STEP_FAILED, classify_failure
from worker_svc.worker.sizing import CPU_KV_CACHE_MB

__all__ = [
    "CPU_KV_CACHE_MB",
    "DEVICE_LOST",
    "OUT_OF_MEMORY",
    "STEP_FAILED",
    "UnsupportedModel",
    "Worker",
    "architectures",
    "classify_failure",
    "resolve_kv_dtype",
    "use_device",
]
