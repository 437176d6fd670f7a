"""Ranks 1..N-1 of a tensor-parallel worker: each its own process, started by
rank 0 (group.TensorParallelGroup.launch). It builds its shard of the model
and its share of the KV cache exactly as rank 0 does (worker.Worker), says it
is ready, then runs every step rank 0 sends, in order, until told to stop or
rank 0 goes away."""

from __future__ import annotations

import os
import pickle
import signal
from multiprocessing.connection import Connection

import structlog

from svc_common.log_setup import configure_logging
from worker_svc.config import WorkerConfig
from worker_svc.parallel.group import READY, TensorParallelGroup
from worker_svc.step_input import InvalidStep

log = structlog.get_logger("worker_svc.rank")


def run_rank(config: WorkerConfig, rank: int, init_method: str, pipe: Connection) -> None:
    # Ctrl-C and SIGTERM reach the whole process group: rank 0 decides when the ranks stop.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    configure_logging(config.log_format, config.log_level)
    structlog.contextvars.bind_contextvars(rank=rank)
    from worker_svc.worker import Worker  # torch and the model load here

    try:
        worker = Worker(config, parallel=TensorParallelGroup.join(config, rank, init_method))
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
            worker.runner.execute(step)
        except InvalidStep:  # rank 0 raised the same, before any collective
            continue
        except Exception:  # the ranks are out of step now: rank 0 sees this one exit and goes down
            log.exception("tensor-parallel rank failed a step", step_id=step.step_id)
            os._exit(1)
    log.debug("tensor-parallel rank stopping")
