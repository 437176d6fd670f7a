"""The scheduler's engine: one EngineCore per worker, request routing, stats."""
from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import grpc
import structlog

from scheduler_svc.block_pool import BlockPool
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine_core import EngineCore, WorkerUnavailable
from scheduler_svc.kv_cache_manager import KVCacheManager
from scheduler_svc.output import RequestStream
from scheduler_svc.planner import Planner, PlannerConfig
from scheduler_svc.request import Request
from scheduler_svc.tokenizer import ModelTokenizer
from scheduler_svc.worker_client import WorkerClient, WorkerInfo

log = structlog.get_logger(__name__)


class StartupError(RuntimeError):
    """A worker could not be reached or does not match the others."""


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    tokens_in_cache: int
    steps_run: int
    requests_finished: int
    preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_workers: int


class Engine:
    def __init__(self, cores: list[EngineCore], tokenizer: ModelTokenizer, max_model_len: int):
        self.cores = cores
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._seq_ids = itertools.count(1)
        self._owner: dict[str, EngineCore] = {}

    @classmethod
    async def connect(cls, config: SchedulerConfig, tokenizer: ModelTokenizer) -> "Engine":
        clients = [WorkerClient(a, config.max_message_mb) for a in config.worker_addresses]
        infos = await asyncio.gather(*(_first_info(c, config.connect_timeout_s) for c in clients))
        _check_compatible(infos, tokenizer)
        cores = [EngineCore(c, info, _planner(config, info), tokenizer, config.worker_timeout_s)
                 for c, info in zip(clients, infos)]
        engine = cls(cores, tokenizer, cores[0].planner.max_len)
        for core in cores:
            core.start()
        return engine

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    def submit(self, request: Request) -> RequestStream:
        """Queue a request on the least loaded healthy worker; raises RequestRejected,
        QueueFull or WorkerUnavailable."""
        healthy = [c for c in self.cores if c.healthy]
        if not healthy:
            raise WorkerUnavailable("no worker is available")
        core = min(healthy, key=lambda c: c.load)
        stream = core.add(request)
        self._owner[request.request_id] = core
        return stream

    def release(self, request_id: str) -> None:
        """The client's stream ended (done, cancelled or timed out): abort if still live."""
        core = self._owner.pop(request_id, None)
        if core is not None:
            core.abort(request_id)

    def stats(self) -> EngineStats:
        usages = [c.planner.kv.usage() for c in self.cores]
        counters = [c.counters for c in self.cores]
        return EngineStats(
            running=sum(c.planner.num_running for c in self.cores),
            waiting=sum(c.planner.num_waiting for c in self.cores),
            blocks_total=sum(u.num_blocks for u in usages),
            blocks_used=sum(u.used_blocks for u in usages),
            blocks_free=sum(u.free_blocks for u in usages),
            tokens_in_cache=sum(u.tokens_held for u in usages),
            steps_run=sum(c.steps_run for c in counters),
            requests_finished=sum(c.requests_finished for c in counters),
            preemptions=sum(c.planner.num_preemptions for c in self.cores),
            prompt_tokens_total=sum(c.prompt_tokens for c in counters),
            generation_tokens_total=sum(c.generation_tokens for c in counters),
            num_workers=len(self.cores),
        )

    def audit(self) -> None:
        for core in self.cores:
            core.planner.audit()

    async def stop(self) -> None:
        for core in self.cores:
            await core.stop()
            await core.client.close()


def _planner(config: SchedulerConfig, info: WorkerInfo) -> Planner:
    max_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
    pool = BlockPool(info.num_blocks, info.block_size, enable_prefix_caching=config.prefix_caching)
    # Anything that changes a block's KV besides its tokens keys the prefix hash.
    kv = KVCacheManager(pool, extra_keys=(info.model_name, info.model_type, info.dtype, info.kv_dtype))
    return Planner(PlannerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                 max_num_seqs=config.max_num_seqs, chunk_size=config.chunk_size,
                                 max_model_len=max_len, max_waiting=config.max_waiting,
                                 block_size=info.block_size), kv)


async def _first_info(client: WorkerClient, timeout_s: float) -> WorkerInfo:
    try:
        info = await client.info(timeout_s=timeout_s, wait_for_ready=True)
    except grpc.aio.AioRpcError as err:
        raise StartupError(f"worker {client.address} did not answer Info within {timeout_s}s "
                           f"({err.code().name}: {err.details()})") from None
    log.info("worker connected", worker=client.address, model=info.model_name, num_blocks=info.num_blocks,
             kv_dtype=info.kv_dtype, device=info.device)
    return info


def _check_compatible(infos: list[WorkerInfo], tokenizer: ModelTokenizer) -> None:
    first = infos[0]
    for info in infos[1:]:
        if (info.model_name, info.vocab_size, info.block_size) != (first.model_name, first.vocab_size, first.block_size):
            raise StartupError(f"worker {info.address} serves {info.model_name} (vocab {info.vocab_size}, block "
                               f"{info.block_size}), unlike {first.address}: all workers must serve the same model")
    if tokenizer.vocab_size > first.vocab_size:
        raise StartupError(f"tokenizer vocab {tokenizer.vocab_size} exceeds the model's {first.vocab_size}")
