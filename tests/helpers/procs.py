"""Service processes for tests (see tools.processes): starting several side
by side, and a free port to hand a service."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from tools.processes import REPO, Cluster, ServiceProcess

__all__ = ["REPO", "Cluster", "ServiceProcess", "free_port", "running"]


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


def free_port() -> int:
    """A port nothing listens on now, for a flag that takes a fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
