"""Sizing the KV pool from device memory (CUDA), as vLLM does: the pool gets what
is left of --gpu-memory-utilization x the GPU's memory once everything else a
step will need is counted, and everything else is measured, not guessed.

Before the pool exists, a scratch runner over a one-block cache runs
* a dummy prefill of --max-num-batched-tokens tokens (the largest step the
  scheduler sends: its activations, attention's workspaces, cuBLAS's),
* a sampling step of --max-num-seqs rows at temperature with top-k, top-p and
  min-p (the sampler's [rows, vocab] temporaries and the logits), and
* an eager decode of --max-num-seqs padding rows (what the decode graphs' own
  memory pool will hold, beside the caching allocator's: a graph's memory is
  not shared with eager steps),
and the peak of each above the weights is read from torch's allocator. What the
process holds outside torch's allocator (the CUDA context, library handles) is
the growth of the device's used memory that torch does not account for.

    pool = min(utilization x total - (weights + activation peak + graphs + outside torch),
               free now - (activation peak + graphs),
               --kv-cache-memory-mb if set)

The second bound keeps a GPU shared with other processes from being
overcommitted (utilization counts only this process's own use). `plan_kv_pool`
returns the split, which the worker logs at start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from worker_svc.runner.cuda_graphs import padding_batch
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.runner.upload import InputUploader, upload_batch
from worker_svc.runner.warm_up import mixed_sampling
from worker_svc.sampling.sampler import Sampler
from worker_svc.step.builder import StepBuilder
from worker_svc.step.input import StepInput

MB = 2**20


class DeviceMemory(Protocol):
    """The device's memory as the worker reads it (CudaMemory; a fake in tests)."""

    def info(self) -> tuple[int, int]:
        """(free, total) bytes of the device."""
        ...

    def allocated(self) -> int:
        """Bytes torch's allocator has handed out."""
        ...

    def reserved(self) -> int:
        """Bytes torch's allocator holds from the device (handed out or cached)."""
        ...

    def reset_peak(self) -> None:
        """Start a new peak of allocated() from now (caches emptied first)."""

    def peak(self) -> int:
        """The most allocated() was since reset_peak()."""
        ...


class CudaMemory:
    def __init__(self, device: torch.device):
        self.device = device

    def info(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)


@dataclass(frozen=True)
class MemoryBaseline:
    """The device before the worker loaded anything."""

    used: int  # total - free: other processes, and this one's CUDA context so far
    reserved: int  # torch's allocator's

    @classmethod
    def read(cls, memory: DeviceMemory) -> MemoryBaseline:
        free, total = memory.info()
        return cls(total - free, memory.reserved())


@dataclass(frozen=True)
class KVPoolPlan:
    """Where the device's memory goes, in bytes."""

    total: int
    utilization: float
    weights: int  # torch's allocations after loading, before profiling
    prefill_peak: int  # above the weights: a prefill of --max-num-batched-tokens tokens
    sampler_peak: int  # above the weights: sampling --max-num-seqs rows
    graphs: int  # the decode graphs' pool: an eager decode of --max-num-seqs rows (0 without graphs)
    outside_torch: int  # the process's device memory outside torch's allocator (context, libraries)
    free: int  # free on the device after profiling (the activations released)
    requested: int  # --kv-cache-memory-mb in bytes; 0: no cap
    kv_cache: int  # what the pool gets

    @property
    def activations(self) -> int:
        return max(self.prefill_peak, self.sampler_peak)

    @property
    def bound(self) -> str:
        """Which limit sized the pool."""
        if self.requested and self.kv_cache == self.requested:
            return "--kv-cache-memory-mb"
        if self.kv_cache == max(0, self.free - self.activations - self.graphs):
            return "free device memory"
        return "--gpu-memory-utilization"

    def log_fields(self) -> dict[str, object]:
        mb = {
            name: round(getattr(self, name) / MB)
            for name in ("total", "weights", "prefill_peak", "sampler_peak", "graphs", "outside_torch", "free")
        }
        return {
            **{f"{name}_mb": value for name, value in mb.items()},
            "gpu_memory_utilization": self.utilization,
            "kv_cache_mb": round(self.kv_cache / MB),
            "sized_by": self.bound,
        }


def kv_pool_bytes(
    total: int,
    utilization: float,
    weights: int,
    activations: int,
    graphs: int,
    outside_torch: int,
    free: int,
    requested: int = 0,
) -> int:
    """The pool's bytes (the module docstring's formula): what `utilization` of
    `total` leaves beside this process's other uses, no more than is free beside
    what the steps will take again, and no more than `requested` (0: no cap)."""
    allowed = int(total * utilization) - (weights + activations + graphs + outside_torch)
    budget = min(allowed, free - activations - graphs)
    if requested:
        budget = min(budget, requested)
    return max(0, budget)


def plan_kv_pool(
    scratch: ModelRunner,
    memory: DeviceMemory,
    baseline: MemoryBaseline,
    utilization: float,
    requested: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    graphs_table_width: int | None,
) -> KVPoolPlan:
    """Profile `scratch` (the model over a one-block cache) and size the pool.
    graphs_table_width: the decode graphs' table width, None without graphs."""
    weights = memory.allocated()
    prefill_peak = _peak(memory, lambda: _dummy_prefill(scratch, max_num_batched_tokens, max_model_len))
    sampler_peak = _peak(memory, lambda: _sampling_step(scratch, max_num_seqs))
    graphs = 0
    if graphs_table_width is not None:
        graphs = _peak(memory, lambda: _dummy_decode(scratch, max_num_seqs, graphs_table_width))
    memory.reset_peak()  # releases what the profile cached
    free, total = memory.info()
    outside_torch = max(0, (total - free - baseline.used) - (memory.reserved() - baseline.reserved))
    kv_cache = kv_pool_bytes(
        total, utilization, weights, max(prefill_peak, sampler_peak), graphs, outside_torch, free, requested
    )
    return KVPoolPlan(
        total, utilization, weights, prefill_peak, sampler_peak, graphs, outside_torch, free, requested, kv_cache
    )


def _peak(memory: DeviceMemory, run: Callable[[], None]) -> int:
    """Peak allocated bytes above what was allocated before `run()`."""
    memory.reset_peak()
    before = memory.allocated()
    with torch.inference_mode():
        run()
    return max(0, memory.peak() - before)


def prefill_profile_step(num_tokens: int, max_model_len: int, block_size: int, vocab: int) -> StepInput:
    """Sequences of up to max_model_len tokens, num_tokens in all, each from
    position 0, every one sampled: the largest prefill a step may be. Slots -1
    (nothing written) and tables of block 0 (a one-block scratch cache)."""
    builder = StepBuilder(block_size)
    seq, left = 0, num_tokens
    while left > 0:
        length = min(left, max_model_len)
        tokens = ((np.arange(length) * 7919 + seq) % vocab).tolist()
        builder.add(seq, tokens, 0, [0] * -(-length // block_size), [-1] * length, sample=True)
        seq, left = seq + 1, left - length
    return builder.build(0)


def _dummy_prefill(runner: ModelRunner, num_tokens: int, max_model_len: int) -> None:
    step = prefill_profile_step(num_tokens, max_model_len, runner.cache.block_size, runner.model.spec.vocab_size)
    runner.logits(step, use_graphs=False)


def _sampling_step(runner: ModelRunner, rows: int) -> None:
    """The lm_head over `rows` rows (rounded up to even) and a sampling step of
    them, half at temperature with every filter: the widest temporaries."""
    pairs = -(-rows // 2)
    model = runner.model
    hidden = torch.zeros(2 * pairs, model.spec.hidden_size, dtype=model.dtype, device=model.device)
    Sampler(0).sample_packed(model.logits(hidden), mixed_sampling(pairs, 0)).tensor.cpu()


def _dummy_decode(runner: ModelRunner, rows: int, table_width: int) -> None:
    batch = upload_batch(padding_batch(rows, table_width), InputUploader(runner.model.device))
    runner.model.logits(runner.forward(batch))
