"""The gateway's `GET /metrics` (Prometheus text, prometheus_client): HTTP
requests counted by route, method and status, and their latency up to the
last byte sent, so a streamed completion counts whole. Routes are the app's
path templates; a path that matches none is `other`, so scanners cannot grow
the label set."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# From a health check to a long streamed answer.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNMATCHED = "other"


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()  # one per app: tests run several gateways in one process
        labels = ["route", "method", "status"]
        self.requests = Counter(
            "pagedserve_gateway_http_requests", "HTTP requests answered", labels, registry=self.registry
        )
        self.latency = Histogram(
            "pagedserve_gateway_http_request_duration_seconds",
            "request received to the last byte of the response sent",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        labels = {"route": route, "method": method, "status": str(status)}
        self.requests.labels(**labels).inc()
        self.latency.labels(**labels).observe(seconds)


class MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware): it must not buffer streamed bodies."""

    def __init__(self, app: ASGIApp, metrics: HttpMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500  # an exception that escapes is a 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router put the matched route in the scope (the same dict).
            route = getattr(scope.get("route"), "path", UNMATCHED)
            self.metrics.observe(route, scope["method"], status, time.perf_counter() - started)


def install_metrics(app: FastAPI) -> None:
    """Count every request of `app` and serve the counts on GET /metrics (no API key, like /health)."""
    metrics = HttpMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    async def serve_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", serve_metrics, methods=["GET"], include_in_schema=False)
