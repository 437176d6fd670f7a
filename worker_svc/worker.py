"""A worker: the model, its paged KV cache and the step executor, built from config.
No request state lives here; every step says everything it needs."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from worker_svc.attention import load_ops, resolve_backend
from worker_svc.config import WorkerConfig
from worker_svc.kv_cache import KVCachePool, PagedKVCache, make_kv_cache
from worker_svc.model_runner import ModelRunner, StepOutput
from worker_svc.models import DecoderModel, load_spec
from worker_svc.parallel.group import TensorParallelGroup
from worker_svc.parallel.sampling import SamplingRank
from worker_svc.sampler import Sampler
from worker_svc.step_input import Limits, StaleStep, StepInput, validate

log = structlog.get_logger(__name__)

# How long a step planned ahead waits for the step it names (sent just before it).
PREVIOUS_STEP_WAIT_S = 5.0
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
                device=_describe(device),
                compute_capability=f"{capability[0]}.{capability[1]}",
                needs=f"{FP8_MIN_CUDA_CAPABILITY[0]}.{FP8_MIN_CUDA_CAPABILITY[1]}",
            )
            return torch.int8
    return dtype


@dataclass(frozen=True)
class WorkerInfo:
    model_name: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_dtype: str
    dtype: str
    device: str
    instance_id: str
    kv_bytes_per_block: int  # all layers, K and V, scales included
    sliding_window: int
    attention_backend: str
    kv_bytes_per_token: int  # kv_bytes_per_block / block_size
    kv_scale_bytes_per_block: int  # the scales' and zero points' share of kv_bytes_per_block
    kv_dtype_requested: str  # --kv-dtype as configured; kv_dtype is what it resolved to
    kv_layout: str = "paged"  # contiguous: num_blocks = slots, block_size = max_seq_len
    max_batch: int = 0  # contiguous: slots (sequences at once); paged: 0, no limit
    tensor_parallel_size: int = 1
    kv_bytes_per_block_per_rank: int = 0  # one rank's share; kv_bytes_per_block counts every rank


class Worker:
    def __init__(self, config: WorkerConfig, parallel: TensorParallelGroup | None = None):
        """`parallel`: this process's rank of a tensor-parallel worker (ranks 1..N-1 pass
        theirs, worker_svc/parallel/rank.py); with --tensor-parallel-size > 1 and none
        given, this process is rank 0 and starts the others."""
        self.config = config
        if config.num_threads and config.tensor_parallel_size == 1:  # ranks share them out: parallel/group.py
            torch.set_num_threads(config.num_threads)
        if parallel is None and config.tensor_parallel_size > 1:
            parallel = TensorParallelGroup.launch(config)
        self.parallel = parallel
        self.device = parallel.device if parallel else torch.device(config.device)
        dtype = TORCH_DTYPES[config.dtype]
        if parallel:  # this rank's heads, MLP columns and vocabulary slice
            self.model = parallel.load_model(config.model, dtype)
        else:
            self.model = DecoderModel.load(config.model, dtype, self.device)
        spec = self.model.spec  # this rank's head counts
        ranks = parallel.size if parallel else 1
        whole = load_spec(config.model) if parallel else spec
        kv_dtype = resolve_kv_dtype(config.kv_dtype, dtype, self.device)
        max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        # Paged: blocks of --block-size tokens. Contiguous: slots of max_len tokens,
        # one per sequence; the same [layers, ids, kv_heads, tokens, head_dim] tensor.
        contiguous = config.kv_layout == "contiguous"
        tokens_per_id = max_len if contiguous else config.block_size
        num_ids = (config.max_batch if contiguous else config.num_blocks) or self._ids_for_memory(
            kv_dtype, tokens_per_id
        )
        self.cache: KVCachePool = make_kv_cache(
            config.kv_layout,
            spec.num_layers,
            num_ids,
            spec.num_kv_heads,
            tokens_per_id,
            spec.head_dim,
            kv_dtype,
            self.device,
        )
        self.backend = resolve_backend(config.attention_backend, self.device)
        sampler = Sampler(None if config.seed < 0 else config.seed)
        self.runner = ModelRunner(
            self.model, self.cache, load_ops(self.backend), SamplingRank(sampler, parallel) if parallel else sampler
        )
        self.limits = Limits(spec.vocab_size, num_ids, tokens_per_id, max_len, config.kv_layout)
        self.info = WorkerInfo(
            model_name=Path(config.model).resolve().name,
            model_type=spec.model_type,
            num_layers=spec.num_layers,
            num_q_heads=whole.num_q_heads,
            num_kv_heads=whole.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
            max_model_len=max_len,
            block_size=tokens_per_id,
            num_blocks=num_ids,
            kv_dtype=str(kv_dtype).removeprefix("torch."),
            dtype=config.dtype,
            device=_describe(self.device),
            instance_id=uuid.uuid4().hex,
            kv_bytes_per_block=self.cache.block_bytes * ranks,
            sliding_window=spec.sliding_window,
            attention_backend=self.backend,
            kv_bytes_per_token=self.cache.block_bytes * ranks // tokens_per_id,
            kv_scale_bytes_per_block=self.cache.scale_block_bytes * ranks,
            kv_dtype_requested=config.kv_dtype,
            kv_layout=config.kv_layout,
            max_batch=num_ids if contiguous else 0,
            tensor_parallel_size=ranks,
            kv_bytes_per_block_per_rank=self.cache.block_bytes,
        )
        # One step at a time (steps mutate the shared cache), and a step planned
        # ahead only right after the step it names.
        self._step_done = threading.Condition()
        self._last_step: tuple[int, bool] | None = None  # (step id, succeeded) of the step run last
        if parallel is not None and parallel.rank == 0:
            parallel.wait_ready()  # every rank holds its shard and its part of the cache

    def _ids_for_memory(self, kv_dtype: torch.dtype, tokens_per_id: int) -> int:
        """Blocks (or contiguous slots of max_seq_len tokens) that fit in
        --kv-cache-memory-mb, each costing its values and scales."""
        spec = self.model.spec
        per_id = PagedKVCache.bytes_per_block(
            spec.num_layers, spec.num_kv_heads, tokens_per_id, spec.head_dim, kv_dtype
        )
        return max(1, self.config.kv_cache_memory_mb * 2**20 // per_id)

    def step(self, step: StepInput) -> StepOutput:
        """Validates first (raising InvalidStep before anything is touched), then runs.
        A step planned ahead waits (briefly) for the step it names to run first,
        since gRPC may hand the two calls to threads in either order; StaleStep
        if that step is not the one run last."""
        validate(step, self.limits)
        with self._step_done:
            if step.previous_step_id is not None:
                self._await_previous(step.previous_step_id)
            ok = False
            try:
                out = self.parallel.execute(self.runner, step) if self.parallel else self.runner.execute(step)
                ok = True
                return out
            finally:
                self._last_step = (step.step_id, ok)
                self._step_done.notify_all()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do for one rank)."""
        if self.parallel is not None and self.parallel.rank == 0:
            self.parallel.close()

    def _await_previous(self, previous: int) -> None:
        ran = lambda: self._last_step is not None and self._last_step[0] == previous
        if not self._step_done.wait_for(ran, timeout=PREVIOUS_STEP_WAIT_S) or not self._last_step[1]:
            raise StaleStep(
                f"previous_step_id: step {previous} is not the step this worker ran last "
                f"({self._last_step}); it restarted or that step failed"
            )


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
