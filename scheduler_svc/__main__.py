"""python -m scheduler_svc --workers HOST:PORT|dns:///NAME:PORT[,...] --host 127.0.0.1 --port N --model DIR ..."""

from __future__ import annotations

import asyncio
import signal
import sys

import structlog

from scheduler_svc.api.admin import start_admin_server
from scheduler_svc.api.kv_events_zmq import ZmqKvEventPublisher
from scheduler_svc.api.server import SchedulerServer, start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.discovery import WorkerDiscovery
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.errors import StartupError, WorkerUnavailable
from scheduler_svc.observability.exposition import start_metrics_server
from scheduler_svc.observability.metrics import METRICS, engine_hooks
from scheduler_svc.observability.stats import stats_fields
from scheduler_svc.planning.pooling import classifier_pooling, model_pooling
from scheduler_svc.text.tokenizer import load_tokenizer
from svc_common import event_loop
from svc_common.cli import parse_config
from svc_common.log_setup import configure_logging
from svc_common.peer_auth import is_loopback
from svc_common.ready_file import write_ready_file
from svc_common.tls import server_credentials

log = structlog.get_logger("scheduler_svc")
# After the drain: time for the last messages (and UNAVAILABLE endings) to reach clients.
FINAL_FLUSH_S = 2.0


async def serve(config: SchedulerConfig) -> None:
    tokenizer = load_tokenizer(config.tokenizer_dir)
    # --runner pooling: the checkpoint's pooling config read (and refused if not served) before anything
    # starts, or --classifier-from-token's tokens looked up in the vocabulary.
    pooling = model_pooling(config.model) if config.pooling_runner and not config.classifier_from_token else None
    if config.classifier_from_token:
        pooling = classifier_pooling(config.classifier_from_token, lambda text: tokenizer.encode(text, False))
    api_keys, admin_keys = config.client_keys, config.admin_key_set
    credentials = server_credentials(config.tls_cert, config.tls_key)
    engine = await Engine.connect(config, tokenizer, engine_hooks(METRICS))
    # Prometheus text on --metrics-port, served from this event loop (observability/exposition.py);
    # up before the first request can arrive, so every request is in vLLM's histograms too.
    metrics = await start_metrics_server(engine, config.host, config.metrics_port) if config.metrics_port else None
    # KV events as vLLM publishes them, for KV-aware routers (api/kv_events_zmq.py), before the first request.
    zmq_events = (
        ZmqKvEventPublisher(
            engine.fleet.kv_events,
            config.kv_events_zmq,
            config.kv_events_zmq_replay,
            config.kv_events_zmq_topic,
            admin_keys=admin_keys,
        )
        if config.kv_events_zmq
        else None
    )
    # dns:/// entries of --workers: resolved again every --worker-discovery-interval-s.
    discovery = WorkerDiscovery(engine.fleet, config.worker_targets, config.worker_discovery_interval_s)
    discovery.start()
    server, port = await start_server(
        engine,
        config.host,
        config.port,
        config.max_message_mb,
        config.default_max_tokens,
        credentials=credentials,
        api_keys=api_keys,
        extra_stats=lambda: stats_fields(engine, METRICS),
        max_request_mb=config.max_request_mb,
        max_prompt_chars=config.max_prompt_chars,
        pooling=pooling,
    )
    # admin.v1 (AddWorker, DrainWorker, ListWorkers, SubscribeKvEvents) on its own listener, with
    # the admin keys and the client API's TLS; --admin-port -1: none.
    admin, admin_port = (
        await start_admin_server(
            engine.fleet,
            config.admin_host,
            config.admin_bind_port,
            admin_keys=admin_keys,
            credentials=credentials,
            max_request_mb=config.max_request_mb,
        )
        if config.admin_port >= 0
        else (None, -1)
    )
    log.info(
        "scheduler ready",
        serving=f"{config.host}:{port}",
        workers=[c.info.address for c in engine.cores],
        discovery=[str(t) for t in discovery.targets] or "off",
        max_model_len=engine.max_model_len,
        tls=bool(config.tls_cert),
        api_keys=len(api_keys),
        admin_keys=len(admin_keys),
        worker_tls=bool(config.worker_tls_ca),
        internal_token=bool(config.internal_token_file),
        routing=engine.fleet.routing,
        admin=f"{config.admin_host}:{admin_port}" if admin is not None else "off",
        metrics=f"http://{config.host}:{metrics.port}/metrics" if metrics is not None else "off",
        kv_events_zmq=config.kv_events_zmq or "off",
    )
    if not is_loopback(config.host) and not (config.tls_cert and api_keys):
        log.warning("listening beyond loopback without TLS and API keys", host=config.host)
    if admin is not None and not admin_keys:
        log.warning(
            "admin service without --admin-keys-file: any local process can add and drain workers and read the "
            "KV events",
            admin_host=config.admin_host,
        )
    write_ready_file(config.ready_file, config.host, port, admin_port=admin_port)
    signals = _signal_events()
    await signals.get()
    await discovery.stop()  # no worker joins or leaves during the shutdown
    if admin is not None:
        await admin.stop(1.0)
    await shutdown(engine, server, config.drain_timeout_s, signals)
    if metrics is not None:
        metrics.close()
    if zmq_events is not None:
        await zmq_events.close()


def _signal_events() -> asyncio.Queue[int]:
    """Each SIGINT/SIGTERM puts an item: the first starts the drain, a second cuts it short."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, queue.put_nowait, sig)
    return queue


async def shutdown(
    engine: Engine, server: SchedulerServer, drain_timeout_s: float, signals: asyncio.Queue[int]
) -> None:
    """Health NOT_SERVING and no new admissions; accepted requests get drain_timeout_s
    to finish (a second signal ends the wait); those left end with UNAVAILABLE."""
    log.info("scheduler draining", live_requests=engine.requests.num_live, drain_timeout_s=drain_timeout_s)
    engine.start_draining()
    await server.set_serving(False)
    idle = asyncio.create_task(engine.wait_idle(drain_timeout_s))
    second = asyncio.create_task(signals.get())
    await asyncio.wait([idle, second], return_when=asyncio.FIRST_COMPLETED)
    second.cancel()
    if not (idle.done() and idle.result()):
        idle.cancel()
        await engine.fleet.halt()  # no step may land on requests that are being failed
        failed = engine.fail_all(WorkerUnavailable("the scheduler shut down before the request finished"))
        log.warning("drain cut short", failed=failed)
    await server.stop(FINAL_FLUSH_S)
    engine.log_audit()
    await engine.stop()
    log.info("scheduler stopped")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        SchedulerConfig,
        "PAGEDSERVE_SCHEDULER",
        "pagedserve scheduler: queues, KV block manager, step planner; serving.v1 gRPC",
        argv,
    )
    configure_logging(config.log_format, config.log_level)
    try:
        event_loop.chosen()
    except ValueError as exc:
        sys.exit(f"scheduler: {exc}")
    try:
        event_loop.run(serve(config))
    except (StartupError, OSError) as exc:  # OSError: cannot bind, unreadable key file
        log.error("start-up failed", error=str(exc))
        sys.exit(2)


if __name__ == "__main__":
    main()
