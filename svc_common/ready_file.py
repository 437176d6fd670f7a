"""The ready file: how a launcher (tests, make cluster) learns the port a service
bound, including one the OS picked for --port 0."""

from __future__ import annotations

import json
import os


def write_ready_file(path: str, host: str, port: int, **extra: object) -> None:
    """Atomically write {host, port, pid, **extra} (e.g. the scheduler's admin_port):
    a reader never sees a half-written file."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"host": host, "port": port, "pid": os.getpid(), **extra}, f)
    os.replace(tmp, path)
