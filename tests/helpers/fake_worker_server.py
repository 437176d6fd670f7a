"""worker.v1 served by the pure-Python FakeWorker (no torch): lets scheduler
tests run real gRPC without a model."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import grpc

from proto import worker_pb2, worker_pb2_grpc
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.worker_client import seqs_of, step_response


class FakeWorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        num_blocks: int,
        vocab_size: int,
        block_size: int = 16,
        max_model_len: int = 4096,
        max_num_seqs: int = 0,
        max_loras: int = 0,
        max_lora_rank: int = 0,
    ):
        self.fake = FakeWorker(num_blocks, block_size, vocab_size)
        self.adapter_loads: list[tuple[int, str]] = []  # (slot, name), in order
        self.refuse_adapters: dict[str, str] = {}  # adapter name -> the INVALID_ARGUMENT details it gets
        self.info = worker_pb2.InfoResponse(
            model_name="fake",
            model_type="llama",
            num_layers=1,
            num_q_heads=1,
            num_kv_heads=1,
            head_dim=16,
            vocab_size=vocab_size,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_dtype="float32",
            dtype="float32",
            device="cpu",
            instance_id=uuid.uuid4().hex,
            max_num_seqs=max_num_seqs,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )

    async def Info(self, request, context):
        return self.info

    async def LoadAdapter(self, request, context):
        self.adapter_loads.append((request.slot, request.name))
        refusal = self.refuse_adapters.get(request.name)
        if refusal is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal)
        self.fake.load_adapter(request.slot, request.name)
        return worker_pb2.LoadAdapterResponse(rank=8, target_modules=["q_proj"])

    async def Step(self, request, context):
        previous = request.previous_step_id if request.HasField("previous_step_id") else None
        plan = SimpleNamespace(
            step_id=request.step_id,
            copies=[(c.src, c.dst) for c in request.copies],
            seqs=seqs_of(request),
            previous_step_id=previous,
        )
        samples = self.fake.execute(plan)
        return step_response(
            request.step_id, self.info.instance_id, self.fake.last_sampled, samples.num_accepted, samples.draft_logprobs
        )

    async def StepStream(self, request_iterator, context):
        """Each step as Step runs it (a test's patched Step too); Step's abort ends the stream."""
        async for request in request_iterator:
            yield worker_pb2.StepReply(response=await self.Step(request, context))


async def start_fake_worker(num_blocks: int, vocab_size: int, **kw) -> tuple[grpc.aio.Server, str, FakeWorkerServicer]:
    server = grpc.aio.server()
    servicer = FakeWorkerServicer(num_blocks, vocab_size, **kw)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


def slow_down_steps(monkeypatch, delay_s: float) -> None:
    """Every fake Step takes delay_s more (for this test), so requests are still
    running when the test changes something under them."""
    step = FakeWorkerServicer.Step

    async def slow(self, request, context):
        await asyncio.sleep(delay_s)
        return await step(self, request, context)

    monkeypatch.setattr(FakeWorkerServicer, "Step", slow)


def audit_engine(engine) -> None:
    """Every worker's pool accounted for (Planner.audit raises LeakError otherwise)."""
    for core in engine.cores:
        core.planner.audit()
