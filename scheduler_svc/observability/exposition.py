"""`GET /metrics` through prometheus_client's ASGI app, served by uvicorn on the
scheduler's own event loop: a scrape reads planner and pool state on the thread
that mutates it, so it needs no locks and never sees a half-updated pool
(prometheus_client's threaded server would read from another thread)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import TYPE_CHECKING, Any

import structlog
import uvicorn
from prometheus_client import make_asgi_app

from scheduler_svc.observability.metrics import METRICS, SchedulerMetrics

if TYPE_CHECKING:
    from scheduler_svc.engine.engine import Engine

log = structlog.get_logger(__name__)

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_PATHS = ("/metrics", "/")
# A scrape is one request; closing after it frees the loop of idle keep-alive sockets.
_ONE_SHOT = [(b"connection", b"close")]


class _LoopServer(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM belongs to the scheduler's drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class MetricsEndpoint:
    def __init__(self, server: _LoopServer, task: asyncio.Task[None], port: int):
        self._server, self._task, self.port = server, task, port

    def close(self) -> None:
        self._server.should_exit = True

    async def wait_closed(self) -> None:
        await asyncio.gather(self._task, return_exceptions=True)


def metrics_app(metrics: SchedulerMetrics) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    prometheus = make_asgi_app(metrics.registry)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in _PATHS:
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-type", b"text/plain"), *_ONE_SHOT],
                }
            )
            await send({"type": "http.response.body", "body": b"GET /metrics\n"})
            return
        start: dict[str, Any] = {}

        async def sized(message: MutableMapping[str, Any]) -> None:
            # The app sends its body in one message: give it a length instead of chunking.
            if message["type"] == "http.response.start":
                start.update(message)
                return
            body = message.get("body", b"")
            await send(
                {
                    **start,
                    "headers": [*start.get("headers", []), *_ONE_SHOT, (b"content-length", str(len(body)).encode())],
                }
            )
            await send(message)

        await prometheus(scope, receive, sized)

    return app


async def start_metrics_server(
    engine: Engine, host: str, port: int, metrics: SchedulerMetrics | None = None
) -> MetricsEndpoint:
    """Serve `engine`'s metrics on http://host:port/metrics from the running loop
    (port 0 lets the OS pick: see `.port`). close() + wait_closed() stop it."""
    metrics = metrics if metrics is not None else METRICS
    metrics.register_engine(engine)
    config = uvicorn.Config(
        metrics_app(metrics), host=host, port=port, lifespan="off", log_level="warning", access_log=False
    )
    server = _LoopServer(config)
    task = asyncio.create_task(server.serve(), name="metrics-endpoint")
    while not server.started:
        if task.done():  # it could not bind: surface the error
            task.result()
            raise OSError(f"metrics endpoint: cannot bind {host}:{port}")
        await asyncio.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    log.info("metrics endpoint ready", url=f"http://{host}:{bound}/metrics")
    return MetricsEndpoint(server, task, bound)
