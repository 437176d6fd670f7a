"""admin.v1 gRPC service: add, drain and list workers at run time.

The servicer only validates, converts and maps errors; the work is done by the
engine's fleet (scheduler_svc/engine/fleet.py) through the `AdminEngine` interface below. It is served on its own
listener (`start_admin_server`, 127.0.0.1 by default) rather than on the
client-facing port, and needs an admin key (api/auth.py): whoever can add a
worker decides what every client gets, and the KV events show every tenant's
prompts.

    H="authorization: Bearer $(cat admin.key)"
    grpcurl -plaintext -H "$H" -d '{"address": "127.0.0.1:50062"}' 127.0.0.1:50052 admin.v1.Admin/AddWorker
    grpcurl -plaintext -H "$H" -d '{"address": "127.0.0.1:50061", "wait": true}' 127.0.0.1:50052 \
        admin.v1.Admin/DrainWorker
    grpcurl -plaintext -H "$H" 127.0.0.1:50052 admin.v1.Admin/ListWorkers
    grpcurl -plaintext -H "$H" 127.0.0.1:50052 admin.v1.Admin/SubscribeKvEvents
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import admin_pb2, admin_pb2_grpc
from scheduler_svc.api.auth import admin_key_interceptor
from scheduler_svc.api.status import abort, abort_with
from scheduler_svc.engine.errors import WorkerAdminError
from scheduler_svc.engine.kv_events import KvEventBatch, KvEventHub
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.engine.worker_status import WorkerStatus
from scheduler_svc.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from scheduler_svc.lora.errors import LoraAdapterExists, LoraAdapterNotFound, LoraDisabled, LoraRejected
from scheduler_svc.lora.registry import LoraRegistry
from svc_common.addresses import host_port_problem
from svc_common.grpc_options import server_options

log = structlog.get_logger(__name__)

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name

_STATE_TO_PROTO = {
    WorkerState.SERVING: admin_pb2.WORKER_STATE_SERVING,
    WorkerState.DRAINING: admin_pb2.WORKER_STATE_DRAINING,
    WorkerState.UNHEALTHY: admin_pb2.WORKER_STATE_UNHEALTHY,
    WorkerState.REMOVED: admin_pb2.WORKER_STATE_REMOVED,
}


class AdminEngine(Protocol):
    """What the engine provides to the admin service (scheduler_svc.engine.fleet.Fleet implements it)."""

    kv_events: KvEventHub  # every worker's prefix-index changes
    lora: LoraRegistry | None  # --enable-lora: the adapters requests may name

    @property
    def routing(self) -> str:
        """The routing policy's name: prefix | round-robin | least-loaded."""

    async def add_worker(self, address: str) -> WorkerStatus:
        """Connect (Info, waiting for ready up to connect_timeout_s), check it serves the same
        model/vocab/block size, start its EngineCore and make it routable (SERVING).
        Raises WorkerExists, WorkerUnreachable, WorkerIncompatible."""

    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus:
        """Mark the worker DRAINING (the router skips it; its running and waiting requests
        finish there), then remove it once it holds no request (core stopped, client closed,
        router.forget). wait=False: return at once; wait=True: return when removed, with state
        REMOVED. Cancelling the wait must not undo the drain. Draining an already draining
        worker is not an error, nor is draining one just removed (its final record, REMOVED).
        Raises UnknownWorker, LastWorker."""

    def list_workers(self) -> list[WorkerStatus]:
        """Every known worker (serving, draining, unhealthy), in the order they were added."""


def status_to_proto(status: WorkerStatus) -> admin_pb2.WorkerStatus:
    return admin_pb2.WorkerStatus(
        address=status.address,
        state=_STATE_TO_PROTO.get(status.state, admin_pb2.WORKER_STATE_UNSPECIFIED),
        running=status.running,
        waiting=status.waiting,
        blocks_total=status.blocks_total,
        blocks_used=status.blocks_used,
        blocks_free=status.blocks_free,
        prefix_hit_tokens=status.prefix_hit_tokens,
        prompt_tokens=status.prompt_tokens,
        requests_routed=status.requests_routed,
        requests_finished=status.requests_finished,
        model=status.model,
        device=status.device,
        kv_dtype=status.kv_dtype,
    )


def kv_event_to_proto(event: KVCacheEvent) -> admin_pb2.KvCacheEvent:
    if isinstance(event, BlockStored):
        stored = admin_pb2.BlockStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
            medium=event.medium,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return admin_pb2.KvCacheEvent(block_stored=stored)
    if isinstance(event, BlockRemoved):
        return admin_pb2.KvCacheEvent(
            block_removed=admin_pb2.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
        )
    assert isinstance(event, AllBlocksCleared)
    return admin_pb2.KvCacheEvent(all_blocks_cleared=admin_pb2.AllBlocksCleared())


def kv_batch_to_proto(batch: KvEventBatch) -> admin_pb2.KvEventBatch:
    reply = admin_pb2.KvEventBatch(
        worker=batch.worker,
        data_parallel_rank=batch.rank,
        seq=batch.seq,
        ts=batch.ts,
        events=[kv_event_to_proto(e) for e in batch.events],
    )
    if batch.missed is not None:
        reply.gap.SetInParent()  # a gap of (0, 0) is all default values, and still a gap
        reply.gap.first_missed_seq, reply.gap.last_missed_seq = batch.missed
    return reply


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: AdminEngine):
        self.engine = engine

    async def AddWorker(
        self, request: admin_pb2.AddWorkerRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AddWorkerResponse:
        await _require_address(request.address, context)
        status = await _call(context, "add worker", self.engine.add_worker(request.address))
        log.info("worker added", worker=status.address, state=str(status.state), blocks=status.blocks_total)
        return admin_pb2.AddWorkerResponse(worker=status_to_proto(status))

    async def DrainWorker(
        self, request: admin_pb2.DrainWorkerRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DrainWorkerResponse:
        await _require_address(request.address, context)
        log.info("draining worker", worker=request.address, wait=request.wait)
        status = await _call(
            context,
            "drain worker",
            self.engine.drain_worker(request.address, wait=request.wait, allow_last=request.allow_last),
        )
        return admin_pb2.DrainWorkerResponse(worker=status_to_proto(status))

    async def ListWorkers(
        self, request: admin_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListWorkersResponse:
        try:
            workers = self.engine.list_workers()
        except Exception:  # a bug must not leak a stack trace to the caller
            log.exception("list workers failed")
            await abort(context, grpc.StatusCode.INTERNAL, "list workers failed (see the scheduler log)")
        return admin_pb2.ListWorkersResponse(workers=[status_to_proto(s) for s in workers], routing=self.engine.routing)

    async def LoadLoraAdapter(
        self, request: admin_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.LoadLoraAdapterResponse:
        registry = await _lora(self.engine, context)
        try:
            adapter = registry.register(request.lora_name, request.lora_path)
        except (LoraRejected, LoraAdapterExists) as exc:
            await abort_with(context, exc)
        return admin_pb2.LoadLoraAdapterResponse(lora_name=adapter.name, rank=adapter.rank)

    async def UnloadLoraAdapter(
        self, request: admin_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnloadLoraAdapterResponse:
        registry = await _lora(self.engine, context)
        try:
            registry.unregister(request.lora_name)
        except LoraAdapterNotFound as exc:
            await abort_with(context, exc)
        return admin_pb2.UnloadLoraAdapterResponse()

    async def SubscribeKvEvents(
        self, request: admin_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.KvEventBatch]:
        log.info("kv events subscriber", peer=context.peer(), resume=len(request.last_seq))
        async for batch in self.engine.kv_events.subscribe(dict(request.last_seq)):
            yield kv_batch_to_proto(batch)


async def _lora(engine: AdminEngine, context: grpc.aio.ServicerContext) -> LoraRegistry:
    if engine.lora is None:
        await abort_with(context, LoraDisabled("the scheduler runs without --enable-lora"))
    return engine.lora


async def _require_address(address: str, context: grpc.aio.ServicerContext) -> None:
    if (problem := host_port_problem(address)) is not None:
        await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"address: {problem}")


async def _call(context: grpc.aio.ServicerContext, what: str, awaitable: Awaitable[WorkerStatus]) -> WorkerStatus:
    try:
        return await awaitable
    except WorkerAdminError as exc:
        await abort_with(context, exc)
    except Exception:
        log.exception(f"{what} failed")
        await abort(context, grpc.StatusCode.INTERNAL, f"{what} failed (see the scheduler log)")


def add_admin_to_server(server: grpc.aio.Server, engine: AdminEngine) -> str:
    """Mount admin.v1 on an existing server; returns its service name (for health/reflection)."""
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
    return SERVICE_NAME


async def start_admin_server(
    engine: AdminEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    admin_keys: frozenset[str] = frozenset(),
    credentials: grpc.ServerCredentials | None = None,
    max_request_mb: int | None = None,
) -> tuple[grpc.aio.Server, int]:
    """admin.v1 + health + reflection on their own listener, every call but health
    needing one of `admin_keys` (none: open, which the config allows on loopback only).
    Returns (server, bound port)."""
    interceptors = [admin_key_interceptor(admin_keys)] if admin_keys else []
    options = server_options(reuse_port=False, max_receive_mb=max_request_mb)
    server = grpc.aio.server(interceptors=interceptors, options=options)
    add_admin_to_server(server, engine)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises this (not OSError) when the port is taken
        raise OSError(f"admin service: cannot bind {host}:{port} ({exc})") from None
    if bound == 0:
        raise OSError(f"admin service: cannot bind {host}:{port}")
    await server.start()
    return server, bound
