"""`python -m tests.helpers.warm_tp_worker ARGS`: the real worker (worker_svc's
main) with its warm-up made to run on CPU as it runs on CUDA (worker/core.py's
warms_up True), so a CPU test sees what a tensor-parallel worker on GPUs does
before it serves. The patch is made at import: multiprocessing's spawn imports this module
again in every rank's process, so the ranks run patched too."""

from __future__ import annotations

from worker_svc.__main__ import main
from worker_svc.worker import core

core.warms_up = lambda device, graph_backend: True  # type: ignore[assignment]

if __name__ == "__main__":
    main()
