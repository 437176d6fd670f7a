"""python -m scheduler_svc --workers HOST:PORT[,...] --host 127.0.0.1 --port N --model DIR ..."""
from __future__ import annotations

import asyncio
import signal
import sys

import structlog

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import Engine, StartupError
from scheduler_svc.grpc_server import start_server
from scheduler_svc.tokenizer import load_tokenizer
from svc_common.cli import parse_config
from svc_common.log_setup import configure_logging
from svc_common.ready_file import write_ready_file

log = structlog.get_logger("scheduler_svc")


async def serve(config: SchedulerConfig) -> None:
    tokenizer = load_tokenizer(config.tokenizer_dir)
    engine = await Engine.connect(config, tokenizer)
    server, port = await start_server(engine, config.host, config.port, config.max_message_mb,
                                      config.default_max_tokens)
    log.info("scheduler ready", host=config.host, port=port, workers=config.worker_addresses,
             max_model_len=engine.max_model_len)
    write_ready_file(config.ready_file, config.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("scheduler stopping")
    await server.stop(grace=5)
    await engine.stop()


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER",
                          "pagedserve scheduler: queues, KV block manager, step planner; serving.v1 gRPC", argv)
    configure_logging(config.log_format, config.log_level)
    try:
        asyncio.run(serve(config))
    except (StartupError, FileNotFoundError) as exc:
        log.error("start-up failed", error=str(exc))
        sys.exit(2)


if __name__ == "__main__":
    main()
