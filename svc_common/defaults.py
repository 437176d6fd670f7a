"""Defaults that several services and tools share."""

from __future__ import annotations

from pathlib import Path

# The model `make model` prepares, relative to the repository root.
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"


def model_dir_check(path: str, flag: str) -> tuple[bool, str, str]:
    """A start-up check (ok, flag, what it must be) that `path` is a local model
    directory or GGUF file. Without it a missing path reaches the hub loader and fails
    with a message about repo ids that names neither the flag nor the path."""
    hint = " (run `make model` for the default)" if path == DEFAULT_MODEL else ""
    found = any((Path(path) / name).is_file() for name in ("config.json", "tokenizer.json"))
    gguf = path.endswith(".gguf") and Path(path).is_file()
    return (
        found or gguf,
        flag,
        f"a model directory with config.json or tokenizer.json, or a .gguf file, got {path!r}{hint}",
    )
