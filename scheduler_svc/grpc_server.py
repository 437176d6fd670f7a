"""Builds the scheduler's gRPC server: serving.v1, health, reflection, limits."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.engine import Engine
from scheduler_svc.server import SchedulerServicer

SERVICE_NAME = serving_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


async def start_server(engine: Engine, host: str, port: int, max_message_mb: int,
                       default_max_tokens: int) -> tuple[grpc.aio.Server, int]:
    limit = max_message_mb * 2**20
    server = grpc.aio.server(options=[("grpc.max_send_message_length", limit),
                                      ("grpc.max_receive_message_length", limit)])
    serving_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine, default_max_tokens), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    await server.start()
    return server, bound
