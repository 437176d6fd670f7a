"""Fleet membership: the workers the scheduler serves from, one EngineCore each.
Connecting at start-up (fixed --workers, or the first dns:/// workers that answer),
adding one at run time (admin.v1, DNS discovery: engine/discovery.py), draining
one (nothing new routed there; removed once its requests have finished), and
what each worker's state is. Requests themselves are engine/flow.py's business."""

from __future__ import annotations

import asyncio
import os
import time
from collections import OrderedDict

import structlog

from scheduler_svc.config import DEFAULT_MAX_NUM_SEQS, SchedulerConfig
from scheduler_svc.engine.adapter_loader import AdapterLoader
from scheduler_svc.engine.core import Applied, CoreOptions, EngineCore, Handover
from scheduler_svc.engine.discovery import first_workers
from scheduler_svc.engine.errors import (
    LastWorker,
    StartupError,
    UnknownWorker,
    WorkerCallFailed,
    WorkerExists,
    WorkerIncompatible,
    WorkerUnreachable,
    WorkerUntrusted,
)
from scheduler_svc.engine.kv_events import KvEventHub
from scheduler_svc.engine.router import Router, WorkerState
from scheduler_svc.engine.step_budget import step_budget
from scheduler_svc.engine.timing import EngineHooks
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.engine.worker_status import WorkerStatus
from scheduler_svc.engine.worker_trust import untrusted_worker
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.kv.offload import OffloadPool
from scheduler_svc.kv.slot_manager import SlotManager
from scheduler_svc.kv.tiers import TieredKVCacheManager
from scheduler_svc.lora.errors import LoraAdapterExists, LoraRejected
from scheduler_svc.lora.registry import LoraRegistry
from scheduler_svc.lora.slots import AdapterSlots
from scheduler_svc.planning.planner import Planner
from scheduler_svc.structured.grammars import Grammars
from scheduler_svc.text.tokenizer import ModelTokenizer
from svc_common.targets import Resolver, resolve_dns
from svc_common.tls import channel_credentials

log = structlog.get_logger(__name__)

# How often a draining worker is checked for the end of its last request.
_DRAIN_POLL_S = 0.05
# A removed worker's last record answers a repeated drain for this long (the drain
# is idempotent: a caller whose worker finished draining between two calls gets
# REMOVED, not NOT_FOUND), for at most this many workers.
REMOVED_RECORD_TTL_S = 300.0
_REMOVED_RECORDS_MAX = 256


class Fleet:
    def __init__(
        self,
        cores: list[EngineCore],
        tokenizer: ModelTokenizer,
        config: SchedulerConfig,
        router: Router,
        hooks: EngineHooks[EngineCore] = EngineHooks(),
        resolver: Resolver = resolve_dns,
        lora: LoraRegistry | None = None,
    ) -> None:
        self.cores = cores  # in the order the workers were added
        self.resolver = resolver  # what dns:/// names in --workers resolve to (a trusted worker's address)
        self.tokenizer = tokenizer
        self.config = config
        self.router = router
        self.hooks = hooks
        self.closed = False  # shutting down: no worker joins
        self.reference = cores[0].info  # what every worker must serve (WorkerInfo.mismatch)
        self.max_model_len = cores[0].planner.max_len
        # Structured outputs: one grammar engine for the model every worker serves.
        self.grammars = Grammars(
            tokenizer,
            self.reference.vocab_size,
            config.grammar_limits,
            config.grammar_compile_timeout_s,
            config.grammar_compile_memory_mb,
        )
        # Every worker's prefix-index changes (admin.v1 SubscribeKvEvents, --kv-events-zmq).
        self.kv_events = KvEventHub(config.kv_events_buffer_steps)
        self._handover: Handover | None = None
        self._applied: Applied | None = None
        # Workers being drained: no new request is routed there; each has a task that
        # removes it once it holds no request (its result: the last WorkerStatus).
        self._draining: set[str] = set()
        self._drains: dict[str, asyncio.Task[WorkerStatus]] = {}
        self._adding: set[str] = set()
        self._removed: OrderedDict[str, tuple[WorkerStatus, float]] = OrderedDict()  # address -> (record, when)
        # --enable-lora: the adapters requests may name; each core loads them into its worker's slots.
        self.lora = lora
        for core in cores:
            core.kv_events = self.kv_events.worker(core.info.address)
            core.grammars = self.grammars
            self._attach_lora(core)

    @classmethod
    async def connect(
        cls,
        config: SchedulerConfig,
        tokenizer: ModelTokenizer,
        router: Router,
        hooks: EngineHooks[EngineCore] = EngineHooks(),
        resolver: Resolver = resolve_dns,
    ) -> Fleet:
        """Connect to the fixed workers of --workers (each must answer within
        connect_timeout_s); with dns:/// entries only, to the first of their workers
        that answer (engine/discovery.py adds the others later). Cores not started."""
        targets = config.worker_targets
        fixed = [t.address for t in targets if not t.dns]

        async def open_worker(address: str, tls_server_name: str, timeout_s: float) -> tuple[WorkerClient, WorkerInfo]:
            client = _worker_client(address, config, tls_server_name)
            try:
                return client, await _first_info(client, timeout_s)
            except BaseException:
                await client.close()
                raise

        if fixed:
            workers = await asyncio.gather(*(open_worker(a, "", config.connect_timeout_s) for a in fixed))
        else:
            workers = await first_workers(
                targets, resolver, open_worker, config.connect_timeout_s, config.worker_discovery_interval_s
            )
        first = workers[0][1]
        for _, info in workers:
            if problem := (first.mismatch(info) or _capacity_problem(info, config)):
                raise StartupError(problem)
        if tokenizer.vocab_size > first.vocab_size:
            raise StartupError(f"tokenizer vocab {tokenizer.vocab_size} exceeds the model's {first.vocab_size}")
        options = _core_options(config)
        cores = [EngineCore(c, info, _planner(config, info), tokenizer, options, hooks=hooks) for c, info in workers]
        for core in cores:
            _size_steps(core, config)
        return cls(cores, tokenizer, config, router, hooks, resolver, _lora_registry(config, first))

    def on_lost_worker(self, handover: Handover) -> None:
        """What a core that lost its worker calls to move its requests elsewhere."""
        self._handover = handover
        for core in self.cores:
            core.handover = handover

    def on_applied(self, hook: Applied) -> None:
        """What a core calls after streaming a step's tokens (disaggregation: engine/disagg.py)."""
        self._applied = hook
        for core in self.cores:
            core.on_applied = hook

    @property
    def routing(self) -> str:
        return self.router.name

    @property
    def block_size(self) -> int:
        return self.reference.block_size  # the same on every worker (WorkerInfo.mismatch)

    # ---- states -------------------------------------------------------------
    def state(self, core: EngineCore) -> WorkerState:
        if core.info.address in self._draining:
            return WorkerState.DRAINING
        return WorkerState.SERVING if core.healthy else WorkerState.UNHEALTHY

    def serving_cores(self) -> list[EngineCore]:
        """The cores that take new work: healthy and not being drained."""
        return [c for c in self.cores if self.state(c) is WorkerState.SERVING]

    def list_workers(self) -> list[WorkerStatus]:
        """Every worker (serving, draining, unhealthy), in the order they were added."""
        return [self._status(c) for c in self.cores]

    def _status(self, core: EngineCore, state: WorkerState | None = None) -> WorkerStatus:
        routed = self.router.counters.get(core.info.address)
        return WorkerStatus.from_core(
            core,
            state or self.state(core),
            prefix_hit_tokens=core.counters.finished_cached_prompt_tokens,
            requests_routed=routed.routed if routed else 0,
        )

    def _attach_lora(self, core: EngineCore) -> None:
        if self.lora is not None and core.planner.adapters is not None:
            core.adapters = AdapterLoader(self.lora, core.planner.adapters)

    def _find(self, address: str) -> EngineCore | None:
        return next((c for c in self.cores if c.info.address == address), None)

    # ---- joining ------------------------------------------------------------
    async def add_worker(
        self, address: str, tls_server_name: str = "", timeout_s: float | None = None, discovered: bool = False
    ) -> WorkerStatus:
        """Connect to a worker (Info, waiting up to timeout_s, default connect_timeout_s,
        for it to be ready), check it serves what the others serve, start its core and
        route to it. tls_server_name: the name its certificate carries, when it is dialled
        by IP (found through DNS). discovered: DNS discovery found it (trusted as such);
        otherwise it must be trusted with the internal token (engine/worker_trust.py).
        Raises WorkerExists, WorkerUntrusted, WorkerUnreachable, WorkerIncompatible."""
        if self._find(address) is not None or address in self._adding:
            raise WorkerExists(f"worker {address} is already known")
        if not discovered and (problem := await untrusted_worker(address, self.config, self.resolver)):
            raise WorkerUntrusted(problem)
        self._adding.add(address)
        try:
            client = _worker_client(address, self.config, tls_server_name)
            try:
                try:
                    info = await _first_info(client, timeout_s or self.config.connect_timeout_s)
                except StartupError as exc:
                    raise WorkerUnreachable(str(exc)) from None
                planner = self._check_new_worker(info)
                if self.closed:
                    raise WorkerUnreachable("the scheduler is shutting down")
            except BaseException:
                await client.close()
                raise
            options = _core_options(self.config)
            core = EngineCore(client, info, planner, self.tokenizer, options, self._handover, self.hooks)
            core.on_applied = self._applied
            _size_steps(core, self.config)
            core.kv_events = self.kv_events.worker(address)
            core.grammars = self.grammars
            self._attach_lora(core)
            self.cores.append(core)
            self._removed.pop(address, None)  # a worker again: a drain is a new drain
            core.start()
        finally:
            self._adding.discard(address)
        log.info(
            "worker added", worker=address, model=info.model_name, num_blocks=info.num_blocks, workers=len(self.cores)
        )
        return self._status(core)

    def _check_new_worker(self, info: WorkerInfo) -> Planner:
        """The new worker's planner, if it serves what the others serve; else WorkerIncompatible."""
        if problem := (self.reference.mismatch(info) or _capacity_problem(info, self.config)):
            raise WorkerIncompatible(problem)
        planner = _planner(self.config, info)
        if planner.max_len < self.max_model_len:
            raise WorkerIncompatible(
                f"worker {info.address} holds at most {planner.max_len} tokens per request; "
                f"this scheduler serves up to {self.max_model_len}"
            )
        return planner

    # ---- leaving --------------------------------------------------------------
    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus:
        """Route nothing new to the worker; once its requests have finished (or moved,
        if it fails meanwhile) remove it. wait: return once removed (state REMOVED).
        Idempotent: a worker removed in the last REMOVED_RECORD_TTL_S answers its final
        record (state REMOVED). Raises UnknownWorker, LastWorker."""
        core = self._find(address)
        if core is None:
            if (removed := self._removed_record(address)) is not None:
                return removed
            known = ", ".join(c.info.address for c in self.cores) or "none"
            raise UnknownWorker(f"no worker {address} (workers: {known})")
        if address not in self._draining:
            others = [c for c in self.serving_cores() if c is not core]
            if not others and not allow_last:
                raise LastWorker(
                    f"no other worker is serving: draining {address} would leave none "
                    f"(pass allow_last to drain it anyway)"
                )
            self._draining.add(address)
            self._drains[address] = asyncio.create_task(self._drain(core), name=f"drain-{address}")
            log.info(
                "worker draining", worker=address, running=core.planner.num_running, waiting=core.planner.num_waiting
            )
        if not wait:
            return self._status(core)
        # A cancelled wait (the client went away) must not cancel the drain itself.
        return await asyncio.shield(self._drains[address])

    async def _drain(self, core: EngineCore) -> WorkerStatus:
        address = core.info.address
        try:
            while not core.planner.idle:
                await asyncio.sleep(_DRAIN_POLL_S)
            # Still listed (DRAINING) while it stops: a second drain_worker(wait=True) waits too.
            await core.stop()
            await core.client.close()
            core.healthy = False  # whoever still holds it (a PinPrefix in progress) gets WorkerUnavailable
            status = self._status(core, WorkerState.REMOVED)
            self.cores.remove(core)
            self._remember_removed(status)
            self.router.forget(address)
            self.kv_events.worker_removed(address)
            core.audit()
            log.info(
                "worker removed",
                worker=address,
                requests_finished=core.counters.requests_finished,
                blocks_used=status.blocks_used,
                workers=len(self.cores),
            )
            return status
        finally:
            self._draining.discard(address)
            self._drains.pop(address, None)

    def _remember_removed(self, status: WorkerStatus) -> None:
        self._removed[status.address] = (status, time.monotonic())
        self._removed.move_to_end(status.address)
        while len(self._removed) > _REMOVED_RECORDS_MAX:
            self._removed.popitem(last=False)

    def _removed_record(self, address: str) -> WorkerStatus | None:
        entry = self._removed.get(address)
        if entry is None or time.monotonic() - entry[1] > REMOVED_RECORD_TTL_S:
            return None
        return entry[0]

    # ---- shutdown -----------------------------------------------------------
    async def halt(self) -> None:
        """Stop every core's step loop (and every worker drain); a step in flight is abandoned."""
        drains = list(self._drains.values())
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        for core in list(self.cores):
            await core.stop()

    async def close(self) -> None:
        await self.halt()
        for core in self.cores:
            await core.client.close()
        self.grammars.close()


def _capacity_problem(info: WorkerInfo, config: SchedulerConfig) -> str | None:
    """Why this scheduler's batch or adapters do not fit the worker; None if they do."""
    lora = info.lora_problem(config.max_lora_rank) if config.enable_lora else None
    return info.batch_problem(config.max_num_seqs) or lora


def _lora_registry(config: SchedulerConfig, info: WorkerInfo) -> LoraRegistry | None:
    """--enable-lora: the registry, with the adapters of --lora-modules read and checked."""
    if not config.enable_lora:
        return None
    # A request's `model` names the base model or an adapter: an adapter may not take the base's names.
    reserved = frozenset({info.model_name, os.path.basename(os.path.normpath(config.model))})
    registry = LoraRegistry(config.max_lora_rank, config.cpu_loras, reserved)
    for name, path in config.lora_module_paths:
        try:
            registry.register(name, path)
        except (LoraRejected, LoraAdapterExists) as exc:
            raise StartupError(f"--lora-modules {name}={path}: {exc}") from None
    return registry


def _core_options(config: SchedulerConfig) -> CoreOptions:
    return CoreOptions(
        worker_timeout_s=config.worker_timeout_s,
        health_interval_s=config.health_interval_s,
        async_scheduling=config.async_scheduling,
    )


def _size_steps(core: EngineCore, config: SchedulerConfig) -> None:
    core.step_budget = step_budget(
        core.planner.config, core.info.device, config.sized_step_target_ms, core.info.address
    )


def _worker_client(address: str, config: SchedulerConfig, tls_server_name: str = "") -> WorkerClient:
    credentials = channel_credentials(config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key)
    return WorkerClient(
        address, config.max_message_mb, credentials, tls_server_name if credentials else "", config.internal_token()
    )


def _planner(config: SchedulerConfig, info: WorkerInfo) -> Planner:
    max_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
    # Anything that changes a block's KV besides its tokens keys the prefix hash.
    extra_keys = (info.model_name, info.model_type, info.dtype, info.kv_dtype)
    kv: KVManager
    if info.kv_layout == "contiguous":  # one max_seq_len slot per sequence (num_blocks slots of block_size)
        kv = SlotManager(info.num_blocks, info.block_size, extra_keys=extra_keys)
    else:
        pool = BlockPool(
            info.num_blocks,
            info.block_size,
            enable_prefix_caching=config.prefix_caching,
            eviction_policy=config.eviction_policy,
            record_events=True,
        )
        max_pinned = None if config.max_pinned_blocks < 0 else config.max_pinned_blocks
        if info.num_offload_blocks and config.prefix_caching:  # a second tier under the prefix cache
            offload = OffloadPool(info.num_offload_blocks, info.block_size, info.offload_medium, config.eviction_policy)
            kv = TieredKVCacheManager(pool, offload, extra_keys=extra_keys, max_pinned_blocks=max_pinned)
        else:
            kv = KVCacheManager(pool, extra_keys=extra_keys, max_pinned_blocks=max_pinned)
    # Unset: the worker's own --max-num-seqs (batch_problem refused one larger than it).
    max_num_seqs = config.max_num_seqs or info.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    # --enable-lora: the worker's slots, as many as both allow (_capacity_problem refused a worker with none).
    adapters = AdapterSlots(min(config.max_loras, info.max_loras)) if config.enable_lora else None
    return Planner(config.planner_config(max_len, info.block_size, max_num_seqs), kv, adapters)


async def _first_info(client: WorkerClient, timeout_s: float) -> WorkerInfo:
    try:
        info = await client.info(timeout_s=timeout_s, wait_for_ready=True)
    except WorkerCallFailed as err:
        raise StartupError(f"worker {client.address} did not answer Info within {timeout_s}s ({err})") from None
    log.info(
        "worker connected",
        worker=client.address,
        model=info.model_name,
        num_blocks=info.num_blocks,
        kv_dtype=info.kv_dtype,
        device=info.device,
    )
    return info
