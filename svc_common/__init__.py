"""Pieces every service shares: dataclass-driven CLI/env configuration and structlog set-up.
No torch here: the scheduler and gateway import it."""
