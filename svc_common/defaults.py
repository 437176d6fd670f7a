"""Defaults that several services and tools share."""
from __future__ import annotations

# The model `make model` prepares, relative to the repository root.
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
