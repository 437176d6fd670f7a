"""Run the gateway app under uvicorn on a socket we bind ourselves.

Binding first is what makes `--port 0` usable: we learn the OS-picked port
before uvicorn starts and publish it in the ready file (tests and scripts read
it there). `GatewayServer` also runs in a background thread for tests.

Stopping (SIGTERM, Ctrl-C, `stop()`) drains: no new connection is accepted,
requests in flight get --drain-timeout-s to finish, and what is still running
then ends cleanly (a stream with an error event and [DONE]) before uvicorn
would cancel it.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import threading
import time

import structlog
import uvicorn

from gateway_svc.app import create_app
from gateway_svc.config import GatewayConfig
from gateway_svc.generation import LiveGenerations
from gateway_svc.http_protocol import head_deadline_protocol
from gateway_svc.scheduler_pool import open_scheduler_client
from svc_common.ready_file import write_ready_file

log = structlog.get_logger("gateway")

# uvicorn waits this much longer than the drain for the streams we ended to close.
_SHUTDOWN_MARGIN_S = 5.0


class PortInUse(OSError):
    """The --port is taken: one line naming it."""


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on
    # accepted sockets whose proto says TCP. With Nagle on, every write after the first
    # on a keep-alive connection (the response body after its headers, each SSE event
    # after the previous one) waits for the client's delayed ACK: ~40 ms per write.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(exc.errno, f"{host}:{port} is in use: choose another --port") from None
        raise
    sock.listen(2048)  # connections queue from here on, before uvicorn accepts them
    return sock


class GatewayServer:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self.port = 0
        self.ready = threading.Event()  # set once uvicorn serves
        self._server: uvicorn.Server | None = None
        self._stop_requested = False

    async def serve(self) -> None:
        sock = bind_socket(self.config.host, self.config.port)
        self.port = sock.getsockname()[1]
        # The grpc.aio channels belong to this event loop: create them here, not before.
        client = await open_scheduler_client(self.config)
        try:
            app = create_app(client, self.config)
            uv_config = uvicorn.Config(
                app,
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=int(self.config.drain_timeout_s + _SHUTDOWN_MARGIN_S),
                http=head_deadline_protocol(self.config.header_timeout_s),
                limit_concurrency=self.config.max_connections,
            )
            self._server = uvicorn.Server(uv_config)
            self._server.should_exit = self._stop_requested
            serving = asyncio.create_task(self._server.serve(sockets=[sock]))
            draining = asyncio.create_task(self._drain_when_stopping(self._server, app.state.live))
            try:
                await self._announce_when_started(self._server, serving)
                await serving
            finally:
                draining.cancel()
        finally:
            await client.close()
            sock.close()

    async def _announce_when_started(self, server: uvicorn.Server, serving: asyncio.Task[None]) -> None:
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if not server.started:
            return
        write_ready_file(self.config.ready_file, self.config.host, self.port)  # no-op without --ready-file
        log.info(
            "gateway ready",
            host=self.config.host,
            port=self.port,
            scheduler=self.config.schedulers or self.config.scheduler,
            model=self.config.model_id,
            api_key=bool(self.config.api_key),
            scheduler_tls=bool(self.config.scheduler_tls_ca),
            tenant_salt=self.config.tenant_salt_forced,
        )
        self.ready.set()

    async def _drain_when_stopping(self, server: uvicorn.Server, live: LiveGenerations) -> None:
        while not server.should_exit:
            await asyncio.sleep(0.05)
        timeout_s = self.config.drain_timeout_s
        log.info("gateway draining", in_flight=len(live), drain_timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if live:
            ended = live.shut_down(f"the server is shutting down (requests still running after {timeout_s:g} s)")
            log.warning("drain timeout: requests ended", ended=ended)

    def stop(self) -> None:
        """Ask uvicorn to shut down (safe from another thread: it polls the flag)."""
        self._stop_requested = True
        if self._server is not None:
            self._server.should_exit = True
