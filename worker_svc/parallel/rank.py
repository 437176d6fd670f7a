"""Ranks 1..N-1 of a tensor-parallel worker: each its own process, started by
rank 0 (group.TensorParallelGroup.launch). `serve_rank` builds the rank's worker
through the factory it is given (the worker's rank entry point builds its shard
of the model and its share of the KV cache exactly as rank 0 does), says it is
ready, then runs every step rank 0 sends, in order, until told to stop or rank
0 goes away."""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

import structlog

from worker_svc.parallel.group import READY
from worker_svc.step.errors import InvalidStep

log = structlog.get_logger("worker_svc.rank")


def ignore_stop_signals() -> None:
    """Ctrl-C and SIGTERM reach the whole process group: rank 0 decides when the ranks stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def serve_rank(rank: int, pipe: Connection, build: Callable[[], Callable[[object], object]]) -> None:
    """`build()`: this rank's executor of steps and commands (its worker, built and
    joined to the group)."""
    structlog.contextvars.bind_contextvars(rank=rank)
    try:
        execute = build()
    except Exception as exc:
        log.exception("tensor-parallel rank failed to start")
        pipe.send_bytes(f"{type(exc).__name__}: {exc}".encode())
        os._exit(1)
    pipe.send_bytes(READY)
    while True:
        try:
            step = pickle.loads(pipe.recv_bytes())
        except EOFError:  # rank 0 is gone
            os._exit(1)
        if step is None:
            break
        try:
            execute(step)
        except InvalidStep:  # rank 0 raised the same, before any collective
            continue
        except Exception:  # the ranks are out of step now: rank 0 sees this one exit and goes down
            log.exception("tensor-parallel rank failed a step", step_id=getattr(step, "step_id", None))
            os._exit(1)
    log.debug("tensor-parallel rank stopping")
