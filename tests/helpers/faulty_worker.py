"""`python -m tests.helpers.faulty_worker ARGS`: the real worker (worker_svc's
main, its server, its Worker) whose model runner raises, on its first step, the
error a GPU would raise there: PAGEDSERVE_TEST_FAULT=cuda (an illegal memory
access, which leaves the CUDA context dead) or oom (the caching allocator's out
of memory). Later steps run normally. For the failure-handling tests; no GPU needed."""

from __future__ import annotations

import os

import torch

from worker_svc.__main__ import main
from worker_svc.runner.model_runner import ModelRunner

FAULTS = {
    "cuda": lambda: RuntimeError("CUDA error: an illegal memory access was encountered"),
    "oom": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
}


def _inject(fault: str) -> None:
    real = ModelRunner.execute
    fired = []

    def execute(self, step):  # type: ignore[no-untyped-def]
        if not fired:
            fired.append(step.step_id)
            raise FAULTS[fault]()
        return real(self, step)

    ModelRunner.execute = execute  # type: ignore[method-assign]


if __name__ == "__main__":
    _inject(os.environ["PAGEDSERVE_TEST_FAULT"])
    main()
