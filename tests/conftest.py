"""Shared fixtures (the default model) and pytest hooks; plain helpers live in tests/helpers/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import file_order
from tests.helpers.checkpoints import DEFAULT_MODEL


@pytest.fixture(scope="session")
def default_model() -> Path:
    if not (DEFAULT_MODEL / "config.json").exists():
        pytest.fail(f"{DEFAULT_MODEL} missing: run `make model` (make test does)")
    return DEFAULT_MODEL


def pytest_addoption(parser):
    parser.addoption(
        "--record-file-seconds",
        metavar="PATH",
        help="write each test file's seconds to PATH (JSON) at the end: tests/file_seconds.json orders make test",
    )


def pytest_collection_modifyitems(config, items):
    # On xdist's processes (each collects, and all must order alike): the longest
    # files are handed out first (tests/helpers/file_order.py).
    if hasattr(config, "workerinput"):
        items[:] = file_order.longest_first(items, file_order.load())


def pytest_configure(config):
    if (path := config.getoption("record_file_seconds")) and not hasattr(config, "workerinput"):
        config.pluginmanager.register(file_order.FileSeconds(Path(path)), "file-seconds")
    # Services started by tests must not fight pytest for the 2 cores.
    os.environ.setdefault("PAGEDSERVE_WORKER_NUM_THREADS", "2")
    # Schedulers started by tests serve admin.v1 on an OS-picked port, not the fixed 50052.
    os.environ.setdefault("PAGEDSERVE_SCHEDULER_ADMIN_PORT", "0")
    # Without a GPU the Triton kernels run under the interpreter. Triton reads this
    # when kernels/triton/ defines its @triton.jit functions, so it must be
    # set before any test imports that package; setting it here covers the whole run.
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    # CPU workers started by tests run the C++ kernels (--attention-backend auto): build
    # them here, once, so that no worker's start-up waits on a cold build (make setup
    # normally has; a failed build warns and the workers run the reference ops). The
    # cache is shared: a run from another checkout builds the same library at most once
    # and the other waits for it, saying so (kernels/build_cache.py).
    from kernels import cpu_build

    cpu_build.load()
