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
from worker_svc.kv_cache import PagedKVCache
from worker_svc.model_runner import ModelRunner, StepOutput
from worker_svc.models import DecoderModel
from worker_svc.sampler import Sampler
from worker_svc.step_input import Limits, StepInput, validate

log = structlog.get_logger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


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
    kv_bytes_per_block: int
    sliding_window: int
    attention_backend: str


class Worker:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        dtype = TORCH_DTYPES[config.dtype]
        self.model = DecoderModel.load(config.model, dtype, self.device)
        spec = self.model.spec
        kv_dtype = dtype if config.kv_dtype == "auto" else KV_TORCH_DTYPES[config.kv_dtype]
        num_blocks = config.num_blocks or self._blocks_for_memory(kv_dtype)
        self.cache = PagedKVCache(spec.num_layers, num_blocks, spec.num_kv_heads, config.block_size, spec.head_dim,
                                  kv_dtype, self.device)
        self.backend = resolve_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(self.model, self.cache, load_ops(self.backend),
                                  Sampler(None if config.seed < 0 else config.seed))
        max_len = min(config.max_model_len or spec.max_model_len, spec.max_model_len)
        self.limits = Limits(spec.vocab_size, num_blocks, config.block_size, max_len)
        self.info = WorkerInfo(
            model_name=Path(config.model).resolve().name, model_type=spec.model_type, num_layers=spec.num_layers,
            num_q_heads=spec.num_q_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            vocab_size=spec.vocab_size, max_model_len=max_len, block_size=config.block_size, num_blocks=num_blocks,
            kv_dtype=str(kv_dtype).removeprefix("torch."), dtype=config.dtype, device=_describe(self.device),
            instance_id=uuid.uuid4().hex, kv_bytes_per_block=self.cache.block_bytes,
            sliding_window=spec.sliding_window, attention_backend=self.backend,
        )
        # One step at a time: steps mutate the shared cache.
        self._step_lock = threading.Lock()

    def _blocks_for_memory(self, kv_dtype: torch.dtype) -> int:
        spec = self.model.spec
        per_block = PagedKVCache.bytes_per_block(spec.num_layers, spec.num_kv_heads, self.config.block_size,
                                                 spec.head_dim, kv_dtype)
        return max(1, self.config.kv_cache_memory_mb * 2**20 // per_block)

    def step(self, step: StepInput) -> StepOutput:
        """Validates first (raising InvalidStep before anything is touched), then runs."""
        validate(step, self.limits)
        with self._step_lock:
            return self.runner.execute(step)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)
