"""Builds the scheduler's gRPC server: serving.v1, health, reflection, limits,
optional TLS and API keys, and a health status that follows the engine."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.api.auth import api_key_interceptor
from scheduler_svc.api.serving import ExtraStats, SchedulerServicer
from scheduler_svc.api.status import abort
from scheduler_svc.engine.engine import Engine
from scheduler_svc.request import PoolingOptions
from svc_common.grpc_options import server_options

log = structlog.get_logger(__name__)
SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
HEALTH_SYNC_S = 0.25


@dataclass
class SchedulerServer:
    """The running server. `stop(grace)` like grpc.aio.Server's; health follows
    engine.accepting (NOT_SERVING while no worker can take a request or draining)."""

    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    engine: Engine
    port: int
    _sync_task: asyncio.Task[None] | None = None

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _sync_health(self) -> None:
        serving = None
        while True:
            if self.engine.accepting != serving:
                serving = self.engine.accepting
                await self.set_serving(serving)
                log.info("health", serving=serving)
            await asyncio.sleep(HEALTH_SYNC_S)

    async def stop(self, grace: float | None) -> None:
        if self._sync_task:
            self._sync_task.cancel()
            await asyncio.gather(self._sync_task, return_exceptions=True)
        await self.grpc_server.stop(grace)


async def start_server(
    engine: Engine,
    host: str,
    port: int,
    max_message_mb: int,
    default_max_tokens: int,
    *,
    credentials: grpc.ServerCredentials | None = None,
    api_keys: frozenset[str] = frozenset(),
    extra_stats: ExtraStats = dict,
    max_request_mb: int | None = None,
    max_prompt_chars: int = 0,
    pooling: PoolingOptions | None = None,
) -> tuple[SchedulerServer, int]:
    """max_request_mb: the largest request message, refused by gRPC unparsed (None: max_message_mb);
    max_prompt_chars: the longest text prompt (0: what fits the context); pooling: --runner
    pooling's model pooling (None: the generate runner)."""
    interceptors: list[grpc.aio.ServerInterceptor] = [api_key_interceptor(api_keys)] if api_keys else []
    interceptors.append(ParseErrorInterceptor())  # after auth: an unauthenticated payload is never parsed
    options = server_options(max_message_mb, max_receive_mb=max_request_mb)
    server = grpc.aio.server(interceptors=interceptors, options=options)
    servicer = SchedulerServicer(engine, default_max_tokens, extra_stats, max_prompt_chars, pooling)
    serving_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    running = SchedulerServer(server, health_servicer, engine, bound)
    await running.set_serving(engine.accepting)
    await server.start()
    running._sync_task = asyncio.create_task(running._sync_health(), name="health-sync")
    return running, bound


class ParseErrorInterceptor(grpc.aio.ServerInterceptor):
    """A serving.v1 request that does not parse (invalid UTF-8 in a string field,
    a field of the wrong wire type, truncated bytes) is the caller's mistake:
    INVALID_ARGUMENT naming the message type, instead of gRPC's UNKNOWN."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if (
            handler is None
            or not details.method.startswith(f"/{SERVICE_NAME}/")
            or handler.request_streaming
            or handler.request_deserializer is None
        ):
            return handler
        return _parsing_handler(handler)


def _parsing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request message: {exc}")

    if handler.response_streaming:
        inner = handler.unary_stream

        async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await parsed(raw, context)
            if inspect.isasyncgenfunction(inner):
                async for reply in inner(request, context):
                    yield reply
            else:  # a handler that writes with context.write()
                await inner(request, context)

        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=handler.response_serializer)

    inner_unary = handler.unary_unary

    async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await inner_unary(await parsed(raw, context), context)

    return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)
