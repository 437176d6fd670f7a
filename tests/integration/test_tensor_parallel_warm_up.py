"""Tensor-parallel ranks warm up before the worker serves (issue 27, fault 10):
every rank runs the start-up check's forwards in step with rank 0 (their
collectives pair up), so a first request on GPUs finds every kernel compiled.
On CPU the warm-up is made to run as on CUDA (tests/helpers/warm_tp_worker.py)."""

from __future__ import annotations

import re

import grpc

from proto import worker_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import seq_step, step_request


def test_every_rank_warms_up_before_serving():
    args = ["--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "16"]
    args += ["--tensor-parallel-size", "2"]
    with ServiceProcess("tests.helpers.warm_tp_worker", args) as worker:
        log = worker.log_path.read_text()
        warmed = [line for line in log.splitlines() if "warm-up done" in line]
        ranks = {m.group(1) if (m := re.search(r"rank=(\d+)", line)) else "0" for line in warmed}
        assert ranks == {"0", "1"}, log[-3000:]
        ready = log.index("worker ready")
        assert all(log.index(line) < ready for line in warmed)
        with grpc.insecure_channel(worker.address) as channel:
            reply = worker_pb2_grpc.WorkerStub(channel).Step(step_request(1, [seq_step(1, [5, 6, 7], 0, [0])]))
        assert len(reply.sampled.token_ids) == 1
