"""admin.v1 gRPC service: add, drain and list workers at run time.

The servicer only validates, converts and maps errors; the work is done by the
engine through the `AdminEngine` interface below. It is served on its own
listener (`start_admin_server`, 127.0.0.1 by default) rather than on the
client-facing port: whoever can add a worker decides what every client gets.

    grpcurl -plaintext -d '{"address": "127.0.0.1:50062"}' 127.0.0.1:50052 admin.v1.Admin/AddWorker
    grpcurl -plaintext -d '{"address": "127.0.0.1:50061", "wait": true}' 127.0.0.1:50052 admin.v1.Admin/DrainWorker
    grpcurl -plaintext 127.0.0.1:50052 admin.v1.Admin/ListWorkers
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import admin_pb2, admin_pb2_grpc
from scheduler_svc.router import WorkerState

log = structlog.get_logger(__name__)

SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name

_STATE_TO_PROTO = {
    WorkerState.SERVING: admin_pb2.WORKER_STATE_SERVING,
    WorkerState.DRAINING: admin_pb2.WORKER_STATE_DRAINING,
    WorkerState.UNHEALTHY: admin_pb2.WORKER_STATE_UNHEALTHY,
    WorkerState.REMOVED: admin_pb2.WORKER_STATE_REMOVED,
}


# ---- what the engine raises (each carries its gRPC status code) ---------------
class AdminError(Exception):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnknownWorker(AdminError):
    """No worker with that address."""

    code = grpc.StatusCode.NOT_FOUND


class WorkerExists(AdminError):
    """add_worker: the address is already a worker (serving, draining or unhealthy)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class WorkerUnreachable(AdminError):
    """add_worker: the worker did not answer Info within the connect timeout."""

    code = grpc.StatusCode.UNAVAILABLE


class WorkerIncompatible(AdminError):
    """add_worker: another model, vocabulary or block size than the current workers."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class LastWorker(AdminError):
    """drain_worker: it is the last serving worker and allow_last is false."""

    code = grpc.StatusCode.FAILED_PRECONDITION


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    address: str
    state: WorkerState
    running: int = 0
    waiting: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    blocks_free: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from this worker's prefix cache
    prompt_tokens: int = 0  # prompt tokens of requests admitted on this worker
    requests_routed: int = 0
    requests_finished: int = 0
    model: str = ""
    device: str = ""
    kv_dtype: str = ""

    @classmethod
    def from_core(cls, core, state: WorkerState, prefix_hit_tokens: int = 0,
                  requests_routed: int = 0) -> "WorkerStatus":
        """From an EngineCore (duck-typed: .info, .planner, .counters)."""
        usage = core.planner.kv.usage()
        return cls(address=core.info.address, state=state, running=core.planner.num_running,
                   waiting=core.planner.num_waiting, blocks_total=usage.num_blocks, blocks_used=usage.used_blocks,
                   blocks_free=usage.free_blocks, prefix_hit_tokens=prefix_hit_tokens,
                   prompt_tokens=core.counters.prompt_tokens, requests_routed=requests_routed,
                   requests_finished=core.counters.requests_finished, model=core.info.model_name,
                   device=core.info.device, kv_dtype=core.info.kv_dtype)


class AdminEngine(Protocol):
    """What the Engine provides to the admin service (scheduler_svc.engine.Engine implements it)."""

    routing: str  # the routing policy's name: prefix | round-robin | least-loaded

    async def add_worker(self, address: str) -> WorkerStatus:
        """Connect (Info, waiting for ready up to connect_timeout_s), check it serves the same
        model/vocab/block size, start its EngineCore and make it routable (SERVING).
        Raises WorkerExists, WorkerUnreachable, WorkerIncompatible."""

    async def drain_worker(self, address: str, wait: bool = False, allow_last: bool = False) -> WorkerStatus:
        """Mark the worker DRAINING (the router skips it; its running and waiting requests
        finish there), then remove it once it holds no request (core stopped, client closed,
        router.forget). wait=False: return at once; wait=True: return when removed, with state
        REMOVED. Cancelling the wait must not undo the drain. Draining an already draining
        worker is not an error. Raises UnknownWorker, LastWorker."""

    def list_workers(self) -> list[WorkerStatus]:
        """Every known worker (serving, draining, unhealthy), in the order they were added."""


def status_to_proto(status: WorkerStatus) -> admin_pb2.WorkerStatus:
    return admin_pb2.WorkerStatus(
        address=status.address, state=_STATE_TO_PROTO.get(status.state, admin_pb2.WORKER_STATE_UNSPECIFIED),
        running=status.running, waiting=status.waiting, blocks_total=status.blocks_total,
        blocks_used=status.blocks_used, blocks_free=status.blocks_free, prefix_hit_tokens=status.prefix_hit_tokens,
        prompt_tokens=status.prompt_tokens, requests_routed=status.requests_routed,
        requests_finished=status.requests_finished, model=status.model, device=status.device,
        kv_dtype=status.kv_dtype)


def check_address(address: str) -> str | None:
    """None if `address` is a usable HOST:PORT, else what is wrong with it."""
    if not address or address != address.strip() or "," in address or "/" in address:
        return f"must be HOST:PORT, got {address!r}"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"must be HOST:PORT with a port in 1..65535, got {address!r}"
    return None


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, engine: AdminEngine):
        self.engine = engine

    async def AddWorker(self, request, context):
        await _require_address(request.address, context)
        status = await _call(context, "add worker", self.engine.add_worker(request.address))
        log.info("worker added", worker=status.address, state=str(status.state), blocks=status.blocks_total)
        return admin_pb2.AddWorkerResponse(worker=status_to_proto(status))

    async def DrainWorker(self, request, context):
        await _require_address(request.address, context)
        log.info("draining worker", worker=request.address, wait=request.wait)
        status = await _call(context, "drain worker",
                             self.engine.drain_worker(request.address, wait=request.wait,
                                                      allow_last=request.allow_last))
        return admin_pb2.DrainWorkerResponse(worker=status_to_proto(status))

    async def ListWorkers(self, request, context):
        try:
            workers = self.engine.list_workers()
        except Exception:  # a bug must not leak a stack trace to the caller
            log.exception("list workers failed")
            await context.abort(grpc.StatusCode.INTERNAL, "list workers failed (see the scheduler log)")
        return admin_pb2.ListWorkersResponse(workers=[status_to_proto(s) for s in workers],
                                             routing=getattr(self.engine, "routing", ""))


async def _require_address(address: str, context) -> None:
    if (problem := check_address(address)) is not None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: {problem}")


async def _call(context, what: str, awaitable):
    try:
        return await awaitable
    except AdminError as exc:
        error = (exc.code, str(exc) or type(exc).__name__)
    except Exception:
        log.exception(f"{what} failed")
        error = (grpc.StatusCode.INTERNAL, f"{what} failed (see the scheduler log)")
    await context.abort(*error)


def add_admin_to_server(server: grpc.aio.Server, engine: AdminEngine) -> str:
    """Mount admin.v1 on an existing server; returns its service name (for health/reflection)."""
    admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(engine), server)
    return SERVICE_NAME


async def start_admin_server(engine: AdminEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """admin.v1 + health + reflection on their own listener. Returns (server, bound port)."""
    # No SO_REUSEPORT: a second scheduler on the same admin port must fail to start,
    # not silently share the port (and receive half of the AddWorker calls).
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_admin_to_server(server, engine)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as exc:  # grpcio raises this (not OSError) when the port is taken
        raise OSError(f"admin service: cannot bind {host}:{port} ({exc})") from None
    if bound == 0:
        raise OSError(f"admin service: cannot bind {host}:{port}")
    await server.start()
    return server, bound
