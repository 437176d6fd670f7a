"""The gateway's `GET /metrics` (Prometheus text, prometheus_client), where a
vLLM user scrapes:

* its own HTTP series: requests counted by route, method and status, and their
  latency up to the last byte sent, so a streamed completion counts whole.
  Routes are the app's path templates and methods HTTP's own; a path that
  matches none, or a method HTTP does not define, is `other`, so scanners and
  fuzzers cannot grow the label set (every label value comes from a fixed set);
* the engine's series (`pagedserve_*` and vLLM's `vllm:*`), scraped from the
  schedulers' own endpoints (--scheduler-metrics: their --metrics-port) at each
  request and served after the gateway's. With several schedulers each series
  gets a `scheduler` label; `pagedserve_gateway_scheduler_scrape_up` says which
  answered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

import httpx
import structlog
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

log = structlog.get_logger("gateway")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# From a health check to a long streamed answer.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
UNMATCHED = "other"
# RFC 9110's methods (and PATCH): anything else a client sends is counted as UNMATCHED.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


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
            method = scope["method"] if scope["method"] in METHODS else UNMATCHED
            self.metrics.observe(route, method, status, time.perf_counter() - started)


class SchedulerMetrics:
    """The schedulers' Prometheus endpoints, scraped on demand and merged into one exposition."""

    def __init__(self, targets: str, timeout_s: float) -> None:
        self.targets = [t.strip() for t in targets.split(",") if t.strip()]
        self.timeout_s = timeout_s

    async def exposition(self) -> bytes:
        if not self.targets:
            return b""
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:
            texts = await asyncio.gather(*(self._scrape(http, t) for t in self.targets))
        up = GaugeMetricFamily(
            "pagedserve_gateway_scheduler_scrape_up",
            "1 if the scheduler's metrics endpoint answered this scrape",
            labels=["scheduler"],
        )
        families: dict[str, Metric] = {}
        for target, text in zip(self.targets, texts):
            up.add_metric([target], 0.0 if text is None else 1.0)
            if text is not None:
                extra = {"scheduler": target} if len(self.targets) > 1 else {}
                _merge(families, text_string_to_metric_families(text), extra)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed([up, *families.values()]))
        return generate_latest(registry)

    async def _scrape(self, http: httpx.AsyncClient, target: str) -> str | None:
        try:
            reply = await http.get(f"http://{target}/metrics")
            reply.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("scheduler metrics not scraped", scheduler=target, error=repr(exc))
            return None
        return reply.text


def _merge(into: dict[str, Metric], families: Iterable[Metric], extra: dict[str, str]) -> None:
    """Add the parsed families' samples (with `extra` labels) to `into`, one family per name."""
    for family in families:
        merged = into.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
        merged.samples += [s._replace(labels={**s.labels, **extra}) for s in family.samples]


class _Fixed:
    """A collector of families already built (prometheus_client renders them)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def install_metrics(app: FastAPI, schedulers: SchedulerMetrics) -> None:
    """Count every request of `app` and serve the counts, then the schedulers' series,
    on GET /metrics (no API key, like /health)."""
    metrics = HttpMetrics()
    app.add_middleware(MetricsMiddleware, metrics=metrics)

    async def serve_metrics() -> Response:
        own = generate_latest(metrics.registry)
        return Response(own + await schedulers.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route("/metrics", serve_metrics, methods=["GET"], include_in_schema=False)
