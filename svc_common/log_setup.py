"""structlog set-up shared by the services: JSON or console lines on stderr.

Conventions (checked by tests/integration/test_observability.py): every line
about a request carries `request_id`, every line about an engine step
`step_id`. In JSON mode every line on stderr is one JSON object, including the
ones libraries log through the standard `logging` module (grpc, asyncio,
transformers) and Python warnings, which are routed through the same renderer.
"""

from __future__ import annotations

import logging
import sys

import structlog

LOG_FORMATS = ("console", "json")


def _renderer(fmt: str) -> structlog.types.Processor:
    if fmt == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=False)


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        raise ValueError(f"log level must be debug, info, warning or error, got {level!r}")
    shared: list[structlog.types.Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            *shared,
            structlog.processors.format_exc_info,
            _renderer(fmt),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # One write per line (the line and its newline together): stderr writes through,
        # so print()'s two writes let a tensor-parallel rank's line land inside another's.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Standard-library logging (libraries) goes through the same renderer.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared, structlog.processors.format_exc_info],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _renderer(fmt)],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_pagedserve", False)]:
        root.removeHandler(old)
    handler._pagedserve = True  # type: ignore[attr-defined]  # configure_logging() may run twice in one process (tests)
    root.addHandler(handler)
    # Libraries: warnings and errors only, as before (Python's last-resort handler), now in our format.
    root.setLevel(max(numeric_level, logging.WARNING))
    logging.captureWarnings(True)
