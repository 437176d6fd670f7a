"""python -m worker_svc --model DIR --host 127.0.0.1 --port N ..."""

from __future__ import annotations

import os
import signal
import sys
import threading

import structlog

from svc_common.cli import parse_config
from svc_common.log_setup import configure_logging
from worker_svc.config import WorkerConfig

log = structlog.get_logger("worker_svc")


def main(argv: list[str] | None = None) -> None:
    config = parse_config(
        WorkerConfig, "PAGEDSERVE_WORKER", "pagedserve worker: model + paged KV cache, gRPC worker.v1", argv
    )
    configure_logging(config.log_format, config.log_level)
    if config.list_architectures:
        from worker_svc.worker import architectures

        sys.stdout.write(architectures())
        return
    if config.cpu_cores:  # before torch starts its threads
        from worker_svc.affinity import pin_to_cores

        pin_to_cores(config.cpu_cores)
    # Torch, the model and the kernels take seconds on a quiet machine, minutes on a busy
    # one: a line now, so a slow start is never a silent one.
    log.info("worker starting: loading torch, the model and the kernels", model=config.model, pid=os.getpid())
    from worker_svc.allocator import keep_freed_memory
    from worker_svc.server import serve  # torch loads here, after the CLI is validated
    from worker_svc.step.errors import WorkerDown
    from worker_svc.worker import UnsupportedModel, Worker

    keep_freed_memory()

    stop = threading.Event()  # set before loading: a SIGTERM during start-up still stops cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        worker = Worker(config)
        server = serve(worker, config)
    except UnsupportedModel as exc:  # the one line naming what is not honoured, no traceback
        log.error("model not supported", model=config.model, error=str(exc))
        sys.exit(2)
    except (OSError, WorkerDown) as exc:  # cannot bind, unreadable files, a tensor-parallel rank that failed
        log.error("start-up failed", error=str(exc))
        sys.exit(2)
    # A tensor-parallel rank that dies, or a CUDA error that kills the device's
    # context, takes this worker down: health NOT_SERVING and a non-zero exit, so the
    # scheduler hands its requests over (or waits for a restart).
    worker.on_failure(stop.set)
    # Python runs a signal's handler on the main thread once it wakes; a SIGTERM that the
    # kernel handed to one of gRPC's threads left an untimed wait asleep for good (a
    # worker that never stopped: test_step_stream hung on it once in a CI run).
    while not stop.wait(timeout=0.5):
        pass
    if (reason := worker.failed) is not None:
        server.not_serving()
        server.shutdown(0.5)  # the step in flight has failed with UNAVAILABLE; nothing else can run
        log.error("worker down", reason=reason)
        os._exit(1)  # a rank may be stuck in a collective, a kernel on a dead context: do not wait
    log.info("worker stopping", drain_timeout_s=config.drain_timeout_s)
    # The step in flight finishes (its result reaches the scheduler); new calls are refused.
    server.shutdown(config.drain_timeout_s)
    worker.close()
    log.info("worker stopped")
    # Drained and closed: nothing is left to run. The interpreter's teardown (joining
    # gRPC's and the kernels' threads, finalizing torch's modules) took 0.8-0.9 s more
    # of every stop and restart, and a supervisor waits for the exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
