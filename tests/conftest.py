"""Shared fixtures: tiny checkpoints, the default model, and service processes."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.procs import REPO

DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
TINY_FAMILIES = ("llama", "llama_mqa", "qwen3", "qwen3_mqa", "gemma3", "gemma3_mqa")


def tiny_checkpoint(family: str) -> Path:
    from worker_svc.tiny_checkpoints import ensure_checkpoint

    return ensure_checkpoint(family)


@pytest.fixture(scope="session")
def default_model() -> Path:
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.fail(f"{DEFAULT_MODEL} missing: run `make model` (make test does)")
    return DEFAULT_MODEL


def pytest_configure(config):
    # Services started by tests must not fight pytest for the 2 cores.
    os.environ.setdefault("PAGEDSERVE_WORKER_NUM_THREADS", "2")
