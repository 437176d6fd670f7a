"""A worker process on a checkpoint beside transformers' model of the same
checkpoint (fp32), to compare Worker.Step logits with the reference forward."""

from __future__ import annotations

import grpc
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.procs import ServiceProcess
from tests.helpers.worker_client import step_request

NUM_BLOCKS = 64


class WorkerUnderTest:
    def __init__(self, model_dir, atol: float, worker_args: tuple[str, ...] = ("--num-blocks", str(NUM_BLOCKS))):
        self.proc = ServiceProcess(
            "worker_svc", ["--model", str(model_dir), "--dtype", "float32", *worker_args]
        ).start()
        self.channel = grpc.insecure_channel(self.proc.address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.info = self.stub.Info(worker_pb2.InfoRequest())
        self.atol = atol
        self.step_id = 0

    def step(self, seqs, copies=()):
        self.step_id += 1
        return self.stub.Step(step_request(self.step_id, seqs, copies))

    def ref_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.ref(torch.tensor([ids])).logits[0].numpy()

    def close(self):
        self.channel.close()
        self.proc.stop()
