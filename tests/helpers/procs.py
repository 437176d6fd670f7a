"""Service processes for tests (see svc_common.processes), and starting several side by side."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from svc_common.processes import REPO, Cluster, ServiceProcess

__all__ = ["REPO", "Cluster", "ServiceProcess", "running"]


@contextlib.contextmanager
def running(procs: list[ServiceProcess]) -> Iterator[list[ServiceProcess]]:
    """The processes started side by side (workers load their models at once);
    all stopped on the way out, also when one failed to start."""
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(ServiceProcess.start, procs))
        yield procs
    finally:
        for p in procs:
            p.stop()
