"""The gateway as an operator sees it, against the in-process fake scheduler:
stopping drains (streams in flight finish, or past --drain-timeout-s end with an
error event and [DONE]; never cut), /metrics serves the schedulers' engine and
vllm:* series where a vLLM user scrapes, and a taken port is one clear line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from gateway_svc.config import GatewayConfig
from gateway_svc.server import GatewayServer
from tests.helpers.fake_scheduler import WAIT_S
from tests.helpers.procs import REPO, free_port
from tests.helpers.recorder import read_events, wait_for


def start_gateway(**overrides) -> tuple[GatewayServer, threading.Thread, str]:
    config = GatewayConfig(**{"host": "127.0.0.1", "port": 0, "model_dir": "", "log_level": "warning", **overrides})
    config.validate()
    server = GatewayServer(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    assert server.ready.wait(WAIT_S), "gateway did not start"
    return server, thread, f"http://127.0.0.1:{server.port}"


def stream_in_thread(url: str, events: list[str]) -> threading.Thread:
    return read_events(url, {"prompt": "x", "stream": True}, events, WAIT_S)


# ---- drain -------------------------------------------------------------------------------------
def test_a_stream_that_outlives_the_drain_ends_with_an_error_event_and_done(fake_scheduler):
    fake_scheduler.deltas, fake_scheduler.delay_s = [" tok"] * 500, 0.02  # 10 s: far past the drain
    server, thread, url = start_gateway(scheduler=fake_scheduler.address, drain_timeout_s=0.5)
    events: list[str] = []
    reader = stream_in_thread(url, events)
    wait_for(lambda: len(events) >= 3, WAIT_S, "3 events")
    started = time.monotonic()
    server.stop()
    reader.join(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive() and not reader.is_alive()
    assert time.monotonic() - started < 4.0  # the drain timeout, not the stream's 10 s
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "shutting down" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-2])
    assert fake_scheduler.cancelled.wait(WAIT_S), "the scheduler's call was not cancelled"


def test_a_stream_that_ends_within_the_drain_finishes_whole(fake_scheduler):
    fake_scheduler.deltas, fake_scheduler.delay_s = [" tok"] * 20, 0.05  # 1 s
    server, thread, url = start_gateway(scheduler=fake_scheduler.address, drain_timeout_s=10)
    events: list[str] = []
    reader = stream_in_thread(url, events)
    wait_for(lambda: len(events) >= 2, WAIT_S, "2 events")
    server.stop()
    reader.join(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " tok" * 20
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # No new connection is taken while draining.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


# ---- /metrics: the engine's series where users scrape ------------------------------------------
@pytest.fixture(scope="module")
def engine_endpoints():
    """Two stand-ins for schedulers' --metrics-port endpoints, with a vLLM gauge each."""
    ports = []
    for running in (3, 5):
        registry = CollectorRegistry()
        Gauge("vllm:num_requests_running", "requests running", ["model_name"], registry=registry).labels("m").set(
            running
        )
        server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
        ports.append(server.server_port)
    return [f"127.0.0.1:{p}" for p in ports]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{url}/metrics", timeout=WAIT_S)
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def test_metrics_serve_the_schedulers_series_after_the_gateways(fake_scheduler, engine_endpoints):
    one, two = engine_endpoints
    server, thread, url = start_gateway(scheduler=fake_scheduler.address, scheduler_metrics=one)
    try:
        got = scrape(url)
        assert got[("vllm:num_requests_running", (("model_name", "m"),))] == 3
        assert got[("pagedserve_gateway_scheduler_scrape_up", (("scheduler", one),))] == 1
    finally:
        server.stop()
        thread.join(WAIT_S)
    gone = f"127.0.0.1:{free_port()}"
    server, thread, url = start_gateway(scheduler=fake_scheduler.address, scheduler_metrics=f"{one},{two},{gone}")
    try:
        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
        got = scrape(url)
        running = {dict(labels)["scheduler"]: v for (name, labels), v in got.items() if name.startswith("vllm:")}
        assert running == {one: 3, two: 5}  # each scheduler's series, told apart
        up = {dict(labels)["scheduler"]: v for (name, labels), v in got.items() if name.endswith("scrape_up")}
        assert up == {one: 1, two: 1, gone: 0}
        assert any(name.startswith("pagedserve_gateway_http") for name, _ in got)
    finally:
        server.stop()
        thread.join(WAIT_S)


# ---- a taken port ---------------------------------------------------------------------------------
def test_a_taken_port_is_one_line_naming_the_flag(fake_scheduler):
    server, thread, url = start_gateway(scheduler=fake_scheduler.address)
    try:
        port = url.rsplit(":", 1)[1]
        cmd = [sys.executable, "-m", "gateway_svc", "--scheduler", fake_scheduler.address, "--model-dir", ""]
        run = subprocess.run([*cmd, "--port", port], cwd=REPO, capture_output=True, text=True, timeout=60)
    finally:
        server.stop()
        thread.join(WAIT_S)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1] == f"gateway: 127.0.0.1:{port} is in use: choose another --port"
    assert "Traceback" not in run.stderr
