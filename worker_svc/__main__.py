"""python -m worker_svc --model DIR --host 127.0.0.1 --port N ..."""
from __future__ import annotations

import signal
import threading

from svc_common.cli import parse_config
from svc_common.log_setup import configure_logging
from worker_svc.config import WorkerConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_config(WorkerConfig, "PAGEDSERVE_WORKER", "pagedserve worker: model + paged KV cache, gRPC worker.v1",
                          argv)
    configure_logging(config.log_format, config.log_level)
    from worker_svc.server import serve  # torch loads here, after the CLI is validated
    from worker_svc.worker import Worker

    server = serve(Worker(config), config.host, config.port, config.max_message_mb, config.ready_file)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.stop(grace=5).wait()


if __name__ == "__main__":
    main()
