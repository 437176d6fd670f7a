"""svc_common/event_loop.py: the scheduler's and gateway's loop, and the env var that picks it."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from svc_common import event_loop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


def test_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.chosen() == "uvloop"
    assert event_loop.run(_loop_type()) is uvloop.Loop


def test_asyncio_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    loop_type = event_loop.run(_loop_type())
    assert loop_type is not uvloop.Loop and issubclass(loop_type, asyncio.BaseEventLoop)


def test_unknown_loop_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(event_loop.ENV, "trio")
    with pytest.raises(ValueError, match=f"{event_loop.ENV}: must be one of uvloop, asyncio, got 'trio'"):
        event_loop.chosen()


async def _health_round_trip() -> int:
    """A grpc.aio server and client on the running loop, as the scheduler has them."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            return int(reply.status)
    finally:
        await server.stop(None)


def test_grpc_aio_serves_on_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(event_loop.ENV, raising=False)
    assert event_loop.run(_health_round_trip()) == health_pb2.HealthCheckResponse.SERVING
