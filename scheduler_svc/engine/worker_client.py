"""The scheduler's view of one worker: async gRPC calls, and the only place that
converts worker.v1 protos to and from the planner's data classes."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.engine.errors import WorkerCallFailed
from scheduler_svc.planning.planner import StepPlan
from svc_common.grpc_options import DEFAULT_MAX_MESSAGE_MB, channel_options

# Codes after which the worker may come back: reconnect and recompute.
# ABORTED: a step named a previous step whose samples the worker no longer holds (it restarted).
_TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.ABORTED,
    }
)


@dataclass(frozen=True)
class WorkerInfo:
    address: str
    model_name: str
    model_type: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_dtype: str
    dtype: str
    device: str
    instance_id: str
    kv_bytes_per_block: int
    # paged | contiguous. Contiguous: num_blocks counts slots (== max_batch) and
    # block_size is a slot's length (max_seq_len); see proto/worker.proto.
    kv_layout: str = "paged"
    max_batch: int = 0


@dataclass
class StepResult:
    sampled: dict[int, tuple[int, float]]  # seq_id -> (token id, logprob)
    instance_id: str
    forward_ms: float


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepRequest:
    seqs = []
    for s in plan.seqs:
        o = s.sampling
        sampling = worker_pb2.SamplingParams(temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, seed=o.seed)
        seqs.append(
            worker_pb2.SequenceStep(
                seq_id=s.seq_id,
                token_ids=s.token_ids,
                start_pos=s.start_pos,
                block_table=s.block_table,
                slot_mapping=s.slot_mapping,
                sample=s.sample,
                sampling=sampling,
                token_from_previous_step=s.token_from_previous_step,
            )
        )
    copies = [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in plan.copies]
    return worker_pb2.StepRequest(
        step_id=plan.step_id, copies=copies, seqs=seqs, previous_step_id=plan.previous_step_id
    )


def result_from_proto(reply: worker_pb2.StepResponse) -> StepResult:
    return StepResult(
        sampled={t.seq_id: (t.token_id, t.logprob) for t in reply.sampled},
        instance_id=reply.instance_id,
        forward_ms=reply.timings.forward_ms,
    )


def info_from_proto(address: str, reply: worker_pb2.InfoResponse) -> WorkerInfo:
    return WorkerInfo(
        address=address,
        model_name=reply.model_name,
        model_type=reply.model_type,
        vocab_size=reply.vocab_size,
        max_model_len=reply.max_model_len,
        block_size=reply.block_size,
        num_blocks=reply.num_blocks,
        kv_dtype=reply.kv_dtype,
        dtype=reply.dtype,
        device=reply.device,
        instance_id=reply.instance_id,
        kv_bytes_per_block=reply.kv_bytes_per_block,
        kv_layout=reply.kv_layout or "paged",
        max_batch=reply.max_batch,
    )


class WorkerClient:
    def __init__(
        self,
        address: str,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str = "",
    ):
        # Fast reconnect: a restarted worker is noticed within a second, not gRPC's 120 s backoff.
        # tls_server_name: a worker found through DNS is dialled by IP; its certificate names the DNS name.
        options = channel_options(max_message_mb, fast_reconnect=True, tls_server_name=tls_server_name)
        self.address = address
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    async def info(self, timeout_s: float | None = None, wait_for_ready: bool = False) -> WorkerInfo:
        """Raises WorkerCallFailed."""
        try:
            reply = await self.stub.Info(worker_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError as err:
            raise self._failure(err) from None
        return info_from_proto(self.address, reply)

    async def step(self, plan: StepPlan, timeout_s: float | None = None) -> StepResult:
        """Raises WorkerCallFailed."""
        try:
            reply = await self.stub.Step(plan_to_proto(plan), timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise self._failure(err) from None
        return result_from_proto(reply)

    def _failure(self, err: grpc.aio.AioRpcError) -> WorkerCallFailed:
        code = err.code()
        return WorkerCallFailed(self.address, code in _TRANSIENT, code.name, err.details() or "")

    async def close(self) -> None:
        await self.channel.close()
