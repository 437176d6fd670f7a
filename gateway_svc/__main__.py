"""python -m gateway_svc --scheduler HOST:PORT --host 127.0.0.1 --port N [--model-dir DIR] [--ready-file PATH]"""

from __future__ import annotations

import signal
import sys

from gateway_svc.config import GatewayConfig
from svc_common import event_loop
from svc_common.cli import parse_config
from svc_common.log_setup import configure_logging
from svc_common.malloc_tuning import return_large_blocks


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        GatewayConfig,
        "PAGEDSERVE_GATEWAY",
        "pagedserve gateway: OpenAI-compatible HTTP API over the scheduler's serving.v1 gRPC API",
        argv,
    )
    configure_logging(config.log_format, config.log_level)
    try:
        event_loop.chosen()
    except ValueError as exc:
        sys.exit(f"gateway: {exc}")
    return_large_blocks()
    from gateway_svc.server import GatewayServer, PortInUse  # FastAPI/uvicorn load after the CLI is validated

    # uvicorn handles SIGINT/SIGTERM while serving (graceful shutdown: server.py drains)
    # and then re-raises the signal; these no-op handlers turn that into a clean exit 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    try:
        event_loop.run(GatewayServer(config).serve())
    except PortInUse as exc:
        sys.exit(f"gateway: {exc.strerror}")


if __name__ == "__main__":
    main()
