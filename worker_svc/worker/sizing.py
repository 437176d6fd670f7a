"""How many KV blocks a worker's pools get: the device pool, from memory (a
profile on CUDA, a fixed budget on CPU), and the second tier's, from its flags."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from worker_svc.config import WorkerConfig
from worker_svc.kv_offload import OffloadPool
from worker_svc.parallel.group import TensorParallelGroup
from worker_svc.runner.memory import MB, CudaMemory, MemoryBaseline, plan_kv_pool
from worker_svc.runner.model_runner import ModelRunner
from worker_svc.worker.device import describe

log = structlog.get_logger(__name__)

CPU_KV_CACHE_MB = 512  # --kv-cache-memory-mb 0 (auto) on CPU


def kv_pool_ids(
    config: WorkerConfig,
    per_id: int,
    memory: CudaMemory | None,
    baseline: MemoryBaseline | None,
    scratch: Callable[[], ModelRunner],
    max_len: int,
    graphs_table_width: int | None,
) -> int:
    """Blocks (or contiguous slots of max_seq_len tokens) the pool gets, each
    costing `per_id` bytes, values and scales: --kv-cache-memory-mb (512 by
    default) on CPU; on CUDA what runner/memory.py's profile of the `scratch`
    runner leaves under --gpu-memory-utilization (at most --kv-cache-memory-mb if
    set), logged with where the rest went."""
    requested = config.kv_cache_memory_mb * MB
    if memory is None or baseline is None:
        budget = requested or CPU_KV_CACHE_MB * MB
    else:
        plan = plan_kv_pool(
            scratch(),
            memory,
            baseline,
            config.gpu_memory_utilization,
            requested,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_len,
            graphs_table_width,
        )
        log.info("kv cache sized from device memory", device=describe(memory.device), **plan.log_fields())
        if requested and plan.kv_cache < requested:
            log.warning(
                "kv cache smaller than --kv-cache-memory-mb: the device has no room for more",
                requested_mb=config.kv_cache_memory_mb,
                kv_cache_mb=plan.kv_cache // MB,
                sized_by=plan.bound,
            )
        budget = plan.kv_cache
    return max(1, budget // per_id)


def offload_pool(
    config: WorkerConfig,
    tensors: tuple[torch.Tensor, ...],
    block_bytes: int,
    parallel: TensorParallelGroup | None,
) -> OffloadPool | None:
    """The second KV tier, --kv-offload-blocks or as many blocks as --kv-offload-gb
    holds (tensor-parallel ranks take the smallest count); None without one."""
    blocks = config.kv_offload_blocks or OffloadPool.blocks_for(config.kv_offload_gb, block_bytes)
    if parallel is not None and (config.kv_offload_blocks or config.kv_offload_gb):
        blocks = parallel.min_over_ranks(blocks)
    if not blocks:
        if config.kv_offload_gb:
            raise ValueError(f"--kv-offload-gb {config.kv_offload_gb} holds no block of {block_bytes} bytes")
        return None
    return OffloadPool(tensors, blocks, config.kv_offload_dir)
