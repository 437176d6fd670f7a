"""The scheduler's engine: one EngineCore per worker, request routing
(scheduler_svc/engine/router.py), stats, moving a lost worker's requests to the others
(handover), workers joining and leaving at run time (add_worker, drain_worker:
the admin.v1 service, scheduler_svc/api/admin.py, and DNS discovery,
engine/discovery.py), and draining for a graceful shutdown."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.core import CoreOptions, EngineCore
from scheduler_svc.engine.discovery import first_workers
from scheduler_svc.engine.errors import (
    LastWorker,
    StartupError,
    UnknownWorker,
    WorkerCallFailed,
    WorkerExists,
    WorkerIncompatible,
    WorkerUnavailable,
    WorkerUnreachable,
)
from scheduler_svc.engine.kv_events import KvEventHub
from scheduler_svc.engine.router import Candidate, NoWorkerAvailable, Router, WorkerState, make_router
from scheduler_svc.engine.streams import StreamHandle
from scheduler_svc.engine.timing import EngineHooks
from scheduler_svc.engine.worker_client import WorkerClient, WorkerInfo
from scheduler_svc.engine.worker_status import WorkerStatus
from scheduler_svc.kv.block_manager import KVCacheManager, LeakError
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.kv.slot_manager import SlotManager
from scheduler_svc.planning.planner import Planner, QueueFull
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import Request
from scheduler_svc.text.tokenizer import ModelTokenizer
from svc_common.targets import Resolver, resolve_dns
from svc_common.tls import channel_credentials

log = structlog.get_logger(__name__)

# How often a draining worker is checked for the end of its last request.
_DRAIN_POLL_S = 0.05


@dataclass(frozen=True)
class EngineStats:
    """Engine-wide counts for the Stats RPC (the observability layer adds its own fields)."""

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
    blocks_cached_free: int
    blocks_pinned: int
    prefix_cache_queries: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    evictions: int
    tokens_computed: int
    resumed_tokens: int
    recomputed_tokens: int


class Engine:
    def __init__(
        self,
        cores: list[EngineCore],
        tokenizer: ModelTokenizer,
        max_model_len: int,
        config: SchedulerConfig | None = None,
        router: Router | None = None,
        hooks: EngineHooks = EngineHooks(),
    ):
        self.cores = cores  # in the order the workers were added
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.config = config if config is not None else SchedulerConfig()
        self.router = (
            router
            if router is not None
            else make_router(self.config.routing, affinity_ttl_s=self.config.routing_affinity_ttl_s)
        )
        self.routing = self.router.name
        self.hooks = hooks
        self.draining = False
        self._block_size = cores[0].info.block_size
        # Workers being drained: no new request is routed there; each has a task that
        # removes it once it holds no request (its result: the last WorkerStatus).
        self._draining: set[str] = set()
        self._drains: dict[str, asyncio.Task[WorkerStatus]] = {}
        self._adding: set[str] = set()
        self._seq_ids = itertools.count(1)
        # Client request id -> the planner request ids behind its stream (n > 1: a
        # fork parent and its samples), and each of those -> the core it lives on.
        self._members: dict[str, list[str]] = {}
        self._owner: dict[str, EngineCore] = {}
        # Every worker's prefix-index changes (admin.v1 SubscribeKvEvents, --kv-events-zmq).
        self.kv_events = KvEventHub(self.config.kv_events_buffer_steps)
        for core in cores:
            core.handover = self.handover
            core.kv_events = self.kv_events.worker(core.info.address)

    @classmethod
    async def connect(
        cls,
        config: SchedulerConfig,
        tokenizer: ModelTokenizer,
        hooks: EngineHooks = EngineHooks(),
        resolver: Resolver = resolve_dns,
    ) -> Engine:
        """Connect to the fixed workers of --workers (each must answer within
        connect_timeout_s); with dns:/// entries only, to the first of their workers
        that answer (engine/discovery.py, which adds the others later)."""
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
        infos = [info for _, info in workers]
        _check_compatible(infos, tokenizer)
        options = _core_options(config)
        cores = [EngineCore(c, info, _planner(config, info), tokenizer, options, hooks=hooks) for c, info in workers]
        engine = cls(cores, tokenizer, cores[0].planner.max_len, config, hooks=hooks)
        for core in cores:
            core.start()
        return engine

    def next_seq_id(self) -> int:
        return next(self._seq_ids)

    @property
    def accepting(self) -> bool:
        """New requests can be served: not shutting down and some worker is serving
        (healthy and not being drained)."""
        return not self.draining and any(self._state(c) is WorkerState.SERVING for c in self.cores)

    @property
    def block_size(self) -> int:
        return self._block_size  # the same on every worker (_check_compatible)

    @property
    def num_live(self) -> int:
        """Requests whose client stream is still open."""
        return len(self._members)

    def submit(self, request: Request) -> StreamHandle:
        """Queue a request on the worker the router picks (by default: the longest
        cached prefix of its prompt, then the least loaded); raises RequestRejected,
        QueueFull or WorkerUnavailable."""
        if self.draining:
            raise WorkerUnavailable("the scheduler is shutting down")
        if request.request_id in self._members:  # planners only see their own ids
            raise RequestRejected("request_id", f"{request.request_id!r} is already in use")
        core = self._route(request, self.cores)
        handle = core.add(request)
        self._members[request.request_id] = handle.member_ids
        for member_id in handle.member_ids:
            self._owner[member_id] = core
        return handle

    def _route(self, request: Request, cores: list[EngineCore]) -> EngineCore:
        """The router's choice among `cores` (only SERVING ones are eligible)."""
        candidates = [Candidate.from_core(c, draining=c.info.address in self._draining) for c in cores]
        try:
            decision = self.router.route(request, candidates)
        except NoWorkerAvailable as exc:
            raise WorkerUnavailable(str(exc)) from None
        log.debug(
            "request routed",
            request_id=request.request_id,
            worker=decision.address,
            reason=str(decision.reason),
            cached_tokens=decision.cached_tokens,
            expected_cached_tokens=decision.expected_cached_tokens,
        )
        return next(c for c in cores if c.info.address == decision.address)

    def handover(self, source: EngineCore) -> bool:
        """`source` lost its worker: move its live requests, with their outputs so far
        and their client streams, to the serving workers the router picks (a draining
        worker takes nothing new). False (nothing moved) if there is none; the requests
        then wait for `source` to come back."""
        others = [c for c in self.cores if c is not source and c.healthy and c.info.address not in self._draining]
        if not others:
            return False
        requests, streams = source.take_requests()
        moved = 0
        for request in requests:
            own = {rid: streams.pop(rid) for rid in _request_ids(request) if rid in streams}
            try:
                target = self._route(request, others)
                target.adopt(request)
            except (QueueFull, RequestRejected, WorkerUnavailable) as exc:
                for rid, stream in own.items():
                    stream.fail(
                        "UNAVAILABLE",
                        f"worker {source.info.address} was lost and no other worker could take the request over: {exc}",
                    )
                    self._owner.pop(rid, None)
                continue
            target.adopt_streams(own)
            for rid in _request_ids(request):
                if rid in self._owner:  # not if its client has gone meanwhile
                    self._owner[rid] = target
            moved += 1
            log.info(
                "request moved",
                request_id=request.request_id,
                src=source.info.address,
                dst=target.info.address,
                output_tokens=request.num_output_tokens,
            )
        log.warning(
            "requests moved off a lost worker", worker=source.info.address, moved=moved, failed=len(requests) - moved
        )
        return True

    def release(self, request_id: str) -> None:
        """The client's stream ended (done, cancelled or timed out): abort what is still live."""
        for member_id in self._members.pop(request_id, ()):
            core = self._owner.pop(member_id, None)
            if core is None:
                continue
            try:
                core.abort(member_id)
            except Exception:  # a planner bug: log it, and still abort the other samples
                log.exception("abort failed", request_id=member_id)

    # ---- workers joining and leaving (admin.v1) -------------------------------
    async def add_worker(self, address: str, tls_server_name: str = "", timeout_s: float | None = None) -> WorkerStatus:
        """Connect to a worker (Info, waiting up to timeout_s, default connect_timeout_s,
        for it to be ready), check it serves what the others serve, start its core and
        route to it. tls_server_name: the name its certificate carries, when it is dialled
        by IP (found through DNS). Raises WorkerExists, WorkerUnreachable, WorkerIncompatible."""
        if self._find(address) is not None or address in self._adding:
            raise WorkerExists(f"worker {address} is already known")
        self._adding.add(address)
        try:
            client = _worker_client(address, self.config, tls_server_name)
            try:
                try:
                    info = await _first_info(client, timeout_s or self.config.connect_timeout_s)
                except StartupError as exc:
                    raise WorkerUnreachable(str(exc)) from None
                planner = self._check_new_worker(info)
                if self.draining:
                    raise WorkerUnreachable("the scheduler is shutting down")
            except BaseException:
                await client.close()
                raise
            core = EngineCore(
                client,
                info,
                planner,
                self.tokenizer,
                _core_options(self.config),
                handover=self.handover,
                hooks=self.hooks,
            )
            core.kv_events = self.kv_events.worker(address)
            self.cores.append(core)
            core.start()
        finally:
            self._adding.discard(address)
        log.info(
            "worker added", worker=address, model=info.model_name, num_blocks=info.num_blocks, workers=len(self.cores)
        )
        return self._status(core)

    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus:
        """Route nothing new to the worker; once its requests have finished (or moved,
        if it fails meanwhile) remove it. wait: return once removed (state REMOVED).
        Raises UnknownWorker, LastWorker."""
        core = self._find(address)
        if core is None:
            known = ", ".join(c.info.address for c in self.cores) or "none"
            raise UnknownWorker(f"no worker {address} (workers: {known})")
        if address not in self._draining:
            others = [c for c in self.cores if c is not core and self._state(c) is WorkerState.SERVING]
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

    def list_workers(self) -> list[WorkerStatus]:
        """Every worker (serving, draining, unhealthy), in the order they were added."""
        return [self._status(c) for c in self.cores]

    def serving_cores(self) -> list[EngineCore]:
        """The cores that take new work: healthy and not being drained."""
        return [c for c in self.cores if self._state(c) is WorkerState.SERVING]

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
            self.router.forget(address)
            self.kv_events.worker_removed(address)
            try:
                core.planner.audit()
            except LeakError as exc:
                log.error("engine audit failed", worker=address, error=str(exc))
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

    def _check_new_worker(self, info: WorkerInfo) -> Planner:
        """The new worker's planner, if it serves what the others serve; else WorkerIncompatible."""
        try:
            _check_compatible([*(c.info for c in self.cores), info], self.tokenizer)
        except StartupError as exc:
            raise WorkerIncompatible(str(exc)) from None
        if info.block_size != self._block_size:  # checked above unless no worker is left to compare with
            raise WorkerIncompatible(
                f"worker {info.address} uses {info.block_size}-token blocks, this scheduler "
                f"{self._block_size}: all workers must use the same"
            )
        planner = _planner(self.config, info)
        if planner.max_len < self.max_model_len:
            raise WorkerIncompatible(
                f"worker {info.address} holds at most {planner.max_len} tokens per request; "
                f"this scheduler serves up to {self.max_model_len}"
            )
        return planner

    def _find(self, address: str) -> EngineCore | None:
        return next((c for c in self.cores if c.info.address == address), None)

    def _state(self, core: EngineCore) -> WorkerState:
        if core.info.address in self._draining:
            return WorkerState.DRAINING
        return WorkerState.SERVING if core.healthy else WorkerState.UNHEALTHY

    def _status(self, core: EngineCore, state: WorkerState | None = None) -> WorkerStatus:
        routed = self.router.counters.get(core.info.address)
        return WorkerStatus.from_core(
            core,
            state or self._state(core),
            prefix_hit_tokens=core.counters.finished_cached_prompt_tokens,
            requests_routed=routed.routed if routed else 0,
        )

    # ---- shutdown -----------------------------------------------------------
    def start_draining(self) -> None:
        """Refuse new requests (UNAVAILABLE); those already accepted run to the end."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until every client stream has ended or timeout_s passed; True if idle."""
        deadline = time.monotonic() + timeout_s
        while self._members and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self._members

    def fail_all(self, code: str, message: str) -> int:
        return sum(core.fail_all(code, message) for core in self.cores)

    def stats(self) -> EngineStats:
        usages = [c.planner.kv.usage() for c in self.cores]
        counters = [c.counters for c in self.cores]
        planners = [c.planner for c in self.cores]
        query_tokens = sum(u.prefix_query_tokens for u in usages)
        hit_tokens = sum(u.prefix_hit_tokens for u in usages)
        return EngineStats(
            running=sum(p.num_running for p in planners),
            waiting=sum(p.num_waiting for p in planners),
            blocks_total=sum(u.num_blocks for u in usages),
            blocks_used=sum(u.used_blocks for u in usages),
            blocks_free=sum(u.free_blocks for u in usages),
            tokens_in_cache=sum(u.tokens_held for u in usages),
            steps_run=sum(c.steps_run for c in counters),
            requests_finished=sum(c.requests_finished for c in counters),
            preemptions=sum(p.num_preemptions for p in planners),
            prompt_tokens_total=sum(c.prompt_tokens for c in counters),
            generation_tokens_total=sum(c.generation_tokens for c in counters),
            num_workers=len(self.cores),
            blocks_cached_free=sum(u.cached_free_blocks for u in usages),
            blocks_pinned=sum(u.pinned_blocks for u in usages),
            prefix_cache_queries=sum(u.prefix_queries for u in usages),
            prefix_cache_query_tokens=query_tokens,
            prefix_cache_hit_tokens=hit_tokens,
            prefix_cache_hit_rate=hit_tokens / query_tokens if query_tokens else 0.0,
            evictions=sum(u.blocks_reclaimed for u in usages),
            tokens_computed=sum(c.tokens_computed for c in counters),
            resumed_tokens=sum(p.resumed_tokens for p in planners),
            recomputed_tokens=sum(p.recomputed_tokens for p in planners),
        )

    def audit(self) -> None:
        for core in self.cores:
            core.planner.audit()

    def log_audit(self) -> bool:
        """Audit every pool and log the outcome (at shutdown, when all must be free)."""
        clean = True
        for core in self.cores:
            try:
                core.planner.audit()
            except LeakError as exc:
                clean = False
                log.error("engine audit failed", worker=core.info.address, error=str(exc))
        if clean:
            log.info(
                "engine audit clean",
                blocks_used=sum(c.planner.kv.pool.num_used_blocks for c in self.cores),
                audit_failures=sum(c.counters.audit_failures for c in self.cores),
                worker_failures=sum(c.counters.worker_failures for c in self.cores),
                requests_failed=sum(c.counters.requests_failed for c in self.cores),
            )
        return clean

    async def halt(self) -> None:
        """Stop every core's step loop (and every worker drain); a step in flight is abandoned."""
        drains = list(self._drains.values())
        for task in drains:
            task.cancel()
        await asyncio.gather(*drains, return_exceptions=True)
        for core in list(self.cores):
            await core.stop()

    async def stop(self) -> None:
        await self.halt()
        for core in self.cores:
            await core.client.close()


def _request_ids(request: Request) -> list[str]:
    """The request and its parallel samples: each has its own client stream."""
    return [request.request_id, *(c.request_id for c in request.children)]


def _core_options(config: SchedulerConfig) -> CoreOptions:
    return CoreOptions(
        worker_timeout_s=config.worker_timeout_s,
        health_interval_s=config.health_interval_s,
        async_scheduling=config.async_scheduling,
    )


def _worker_client(address: str, config: SchedulerConfig, tls_server_name: str = "") -> WorkerClient:
    credentials = channel_credentials(config.worker_tls_ca, config.worker_tls_cert, config.worker_tls_key)
    return WorkerClient(address, config.max_message_mb, credentials, tls_server_name if credentials else "")


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
        kv = KVCacheManager(
            pool,
            extra_keys=extra_keys,
            max_pinned_blocks=None if config.max_pinned_blocks < 0 else config.max_pinned_blocks,
        )
    return Planner(config.planner_config(max_len, info.block_size), kv)


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


def _check_compatible(infos: list[WorkerInfo], tokenizer: ModelTokenizer) -> None:
    first = infos[0]
    for info in infos[1:]:
        if (info.model_name, info.vocab_size, info.block_size) != (
            first.model_name,
            first.vocab_size,
            first.block_size,
        ):
            raise StartupError(
                f"worker {info.address} serves {info.model_name} (vocab {info.vocab_size}, block "
                f"{info.block_size}), unlike {first.address}: all workers must serve the same model"
            )
    if tokenizer.vocab_size > first.vocab_size:
        raise StartupError(f"tokenizer vocab {tokenizer.vocab_size} exceeds the model's {first.vocab_size}")
