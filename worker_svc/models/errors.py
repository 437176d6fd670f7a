"""The one error a checkpoint we cannot serve faithfully raises at load."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """A checkpoint, config field or tensor we do not honour, named in the message:
    python -m worker_svc exits with that line (no traceback)."""
