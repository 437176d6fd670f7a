"""The scheduler's view of one worker: async gRPC calls, and the only place that
converts worker.v1 protos to and from the planner's data classes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc
import numpy as np
from numpy.typing import NDArray

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.engine.errors import WorkerCallFailed
from scheduler_svc.planning.plan import Alternatives, PlanMasks, RowPooling, ScheduledSeq, StepPlan, StepSamples
from svc_common.grpc_options import DEFAULT_MAX_MESSAGE_MB, channel_options
from svc_common.peer_auth import bearer_metadata

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


def call_failed(address: str, code_name: str, details: str) -> WorkerCallFailed:
    """A call to the worker that ended with this status code (by name), or a step it
    refused on its stream with that code: transient or not by the code."""
    code = grpc.StatusCode.__members__.get(code_name, grpc.StatusCode.UNKNOWN)
    return WorkerCallFailed(address, code in _TRANSIENT, code.name, details)


def stream_ended(address: str, details: str) -> WorkerCallFailed:
    """A step whose stream ended before its reply: the worker went away, or broke the
    stream's order (transient: reconnect and recompute)."""
    return WorkerCallFailed(address, True, grpc.StatusCode.UNAVAILABLE.name, details)


_POOLING = {
    RowPooling.NONE: worker_pb2.POOLING_NONE,
    RowPooling.LAST: worker_pb2.POOLING_LAST,
    RowPooling.SUM: worker_pb2.POOLING_SUM,
}


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
    max_num_seqs: int = 0  # the worker's --max-num-seqs (0: an older worker that does not say)
    hidden_size: int = 0  # a pooling row's vector length (0: an older worker that does not say)
    num_offload_blocks: int = 0  # its second KV tier (kv/tiers.py); 0: none
    offload_medium: str = ""  # "CPU" | "DISK": where that tier lives (the medium of its KV events)
    max_loras: int = 0  # LoRA adapter slots (0: the worker runs without --enable-lora)
    max_lora_rank: int = 0
    kv_role: str = "both"  # --kv-role: prefill | decode | both (disaggregation; an older worker: both)
    weight_format: str = ""  # "float32", "gguf Q4_1+Q8_0", ... ("": an older worker)
    weights_bytes: int = 0  # the weights' resident bytes on the worker (0: an older worker)

    def batch_problem(self, max_num_seqs: int) -> str | None:
        """Why a scheduler running up to `max_num_seqs` sequences at once cannot use this
        worker (it sized its memory and graphs for fewer); None if it can."""
        if not self.max_num_seqs or max_num_seqs <= self.max_num_seqs:
            return None
        return (
            f"--max-num-seqs {max_num_seqs} is more than worker {self.address} was started for "
            f"(its --max-num-seqs {self.max_num_seqs}: memory and decode graphs are sized for that): give the "
            f"worker the same value, or leave the scheduler's unset to take the worker's"
        )

    def lora_problem(self, max_lora_rank: int) -> str | None:
        """Why a scheduler serving adapters up to rank `max_lora_rank` (--enable-lora)
        cannot use this worker; None if it can."""
        if self.max_loras and self.max_lora_rank >= max_lora_rank:
            return None
        return (
            f"worker {self.address} has {self.max_loras} LoRA slots of rank up to {self.max_lora_rank}: start it "
            f"with --enable-lora and --max-lora-rank {max_lora_rank} or more, as the scheduler"
        )

    def mismatch(self, other: WorkerInfo, same_pool: bool = False) -> str | None:
        """Why `other` cannot serve beside (or, same_pool, in place of) this worker:
        every worker serves the same model, vocabulary and block size; a worker that
        comes back must bring a pool of the same size too. None if it can."""
        pool = ("num_blocks", "num_offload_blocks")
        fields = ("model_name", "vocab_size", "block_size") + (pool if same_pool else ())
        if all(getattr(self, f) == getattr(other, f) for f in fields):
            return None
        return (
            f"worker {other.address} serves {other.model_name} (vocab {other.vocab_size}, block {other.block_size}, "
            f"{other.num_blocks} blocks), unlike {self.address} ({self.model_name}, vocab {self.vocab_size}, "
            f"block {self.block_size}, {self.num_blocks} blocks): "
            + (
                "a worker must come back with the same model and pool"
                if same_pool
                else "all workers must serve the same model"
            )
        )


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What a FetchBlocks moved (disaggregation)."""

    blocks: int
    bytes: int
    read_ms: float
    write_ms: float


@dataclass(frozen=True, slots=True)
class StepResult:
    samples: StepSamples
    instance_id: str  # the worker instance that ran the step
    forward_ms: float
    offload_ms: float = 0.0  # copying blocks down to the second KV tier
    onload_ms: float = 0.0  # and up


_SAMPLE = worker_pb2.SEQ_FLAG_SAMPLE
_FROM_PREVIOUS = worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP
_SEEDED = worker_pb2.SEQ_FLAG_SEEDED
_MASK_FOLLOWS = worker_pb2.SEQ_FLAG_MASK_FOLLOWS
_RETURN_LOGITS = worker_pb2.SEQ_FLAG_RETURN_LOGITS


def plan_to_proto(plan: StepPlan) -> worker_pb2.StepRequest:
    """The plan's sequences as worker.v1 columns: one list per column, extended
    once per sequence, and a SeqExtras only for the rows that need one."""
    seqs = plan.seqs
    token_ids: list[int] = []
    slot_mapping: list[int] = []
    block_tables: list[int] = []
    for s in seqs:
        token_ids += s.token_ids
        slot_mapping += s.slot_mapping
        block_tables += s.block_table
    options = [s.sampling for s in seqs]
    columns = worker_pb2.SeqColumns(
        seq_ids=[s.seq_id for s in seqs],
        start_pos=[s.start_pos for s in seqs],
        num_tokens=[len(s.token_ids) for s in seqs],
        table_lens=[len(s.block_table) for s in seqs],
        flags=[_flags(s) for s in seqs],
        temperature=[o.temperature for o in options],
        top_p=[o.top_p for o in options],
        top_k=[o.top_k for o in options],
        min_p=[o.min_p for o in options],
        seeds=[o.seed or 0 for o in options],
        token_ids=token_ids,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
    )
    if any(s.num_drafts for s in seqs):
        columns.num_drafts.extend([s.num_drafts for s in seqs])
    if any(s.lora_slot for s in seqs):
        columns.lora_slots.extend([s.lora_slot for s in seqs])
    if any(s.pooling for s in seqs):
        columns.pooling.extend([_POOLING[s.pooling] for s in seqs])
    for row, s in enumerate(seqs):
        if _has_extras(s):
            _fill_extras(columns.extras[row], s)
    if plan.masks is not None:
        columns.masks.CopyFrom(masks_to_proto(plan.masks))
    if (inner := _draft_masks(seqs)) is not None:
        columns.draft_masks.CopyFrom(masks_to_proto(inner))
    copies = [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in plan.copies]
    request = worker_pb2.StepRequest(
        step_id=plan.step_id, copies=copies, seqs=columns, previous_step_id=plan.previous_step_id
    )
    if plan.previous_masks is not None:
        request.previous_step_masks.CopyFrom(masks_to_proto(plan.previous_masks))
    if plan.transfers:
        request.offloads.extend(worker_pb2.TierCopy(src=s, dst=d) for s, d in plan.transfers.offloads)
        request.onloads.extend(worker_pb2.TierCopy(src=s, dst=d) for s, d in plan.transfers.onloads)
    return request


def _flags(s: ScheduledSeq) -> int:
    return (
        (_SAMPLE if s.sample else 0)
        | (_FROM_PREVIOUS if s.token_from_previous_step else 0)
        | (_SEEDED if s.sampling.seed is not None else 0)
        | (_MASK_FOLLOWS if s.mask_follows else 0)
        | (_RETURN_LOGITS if s.return_logits else 0)
    )


def _draft_masks(seqs: list[ScheduledSeq]) -> PlanMasks | None:
    """The inner positions' masks of the constrained drafting rows (SeqColumns.draft_masks):
    each such row once per draft, its masks in position order (the last position's is in
    the plan's masks)."""
    masked = [(row, s.position_masks[:-1]) for row, s in enumerate(seqs) if s.position_masks is not None]
    if not masked:
        return None
    rows = [row for row, inner in masked for _ in range(len(inner))]
    return PlanMasks(rows, np.concatenate([inner for _, inner in masked]))


def masks_to_proto(masks: PlanMasks) -> worker_pb2.TokenMasks:
    """The words as little-endian bytes: one copy, no per-word varints."""
    words = masks.words.astype("<i4", copy=False)
    return worker_pb2.TokenMasks(rows=masks.rows, width_words=words.shape[1], words=words.tobytes())


def _has_extras(s: ScheduledSeq) -> bool:
    o = s.sampling
    asks_sampled = s.sample and (o.logprobs or s.blocked_token_ids or o.logit_bias or o.has_penalties)
    return bool(asks_sampled or s.prompt_logprob_targets)


def _fill_extras(extras: worker_pb2.SeqExtras, s: ScheduledSeq) -> None:
    o = s.sampling
    if s.prompt_logprob_targets:
        extras.prompt_logprob_targets.extend(s.prompt_logprob_targets)
        extras.prompt_top_logprobs = o.prompt_logprobs or 0
    if not s.sample:
        return
    extras.top_logprobs = o.logprobs or 0
    extras.blocked_token_ids.extend(s.blocked_token_ids)
    if o.logit_bias:
        ids, values = zip(*o.logit_bias)
        extras.logit_bias_token_ids.extend(ids)
        extras.logit_bias_values.extend(values)
    if o.has_penalties:
        extras.penalties.CopyFrom(
            worker_pb2.Penalties(
                presence=o.presence_penalty,
                frequency=o.frequency_penalty,
                repetition=o.repetition_penalty,
                output_token_ids=s.penalty_output_ids,
                prompt_token_ids=s.penalty_prompt_ids,
            )
        )


def result_from_proto(reply: worker_pb2.StepResponse) -> StepResult:
    """The sampled columns as columns; alternatives only for the rows that have some."""
    c = reply.sampled
    seq_ids = list(c.seq_ids)
    top: dict[int, Alternatives] = {}
    if c.top_token_ids:
        pairs = list(zip(c.top_token_ids, c.top_logprobs))
        end = 0
        for seq_id, count in zip(seq_ids, c.top_counts):
            if count:
                top[seq_id] = tuple(pairs[end : end + count])
                end += count
    prompt = {p.seq_id: _prompt_rows(p) for p in reply.prompt_logprobs}
    samples = StepSamples(
        seq_ids,
        list(c.token_ids),
        list(c.logprobs),
        top,
        prompt,
        list(c.num_accepted),
        list(c.draft_logprobs),
        _pooled(reply.pooled),
        {seq_ids[row]: np.frombuffer(values, dtype="<f4").astype(np.float32) for row, values in c.logits.items()},
    )
    t = reply.timings
    return StepResult(samples, reply.instance_id, t.forward_ms, t.offload_ms, t.onload_ms)


def _pooled(p: worker_pb2.PooledColumns) -> dict[int, NDArray[np.float32]]:
    """seq_id -> its vector, read straight from the bytes."""
    if not p.seq_ids:
        return {}
    values = np.frombuffer(p.values, dtype="<f4").astype(np.float32).reshape(len(p.seq_ids), p.hidden_size)
    return dict(zip(p.seq_ids, values))


def _prompt_rows(p: worker_pb2.PromptLogprobs) -> list[tuple[float, Alternatives]]:
    """(logprob, alternatives) per target: the alternatives come row after row, as many per row."""
    n = len(p.top_token_ids) // len(p.logprobs) if p.logprobs else 0
    pairs = list(zip(p.top_token_ids, p.top_logprobs))
    return [(logprob, tuple(pairs[i * n : (i + 1) * n])) for i, logprob in enumerate(p.logprobs)]


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
        max_num_seqs=reply.max_num_seqs,
        hidden_size=reply.hidden_size,
        num_offload_blocks=reply.num_offload_blocks,
        offload_medium=reply.offload_medium,
        max_loras=reply.max_loras,
        max_lora_rank=reply.max_lora_rank,
        kv_role=reply.kv_role or "both",
        weight_format=reply.weight_format,
        weights_bytes=reply.weights_bytes,
    )


class WorkerClient:
    def __init__(
        self,
        address: str,
        max_message_mb: int = DEFAULT_MAX_MESSAGE_MB,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str = "",
        token: str | None = None,
    ):
        """token: the internal token the worker asks for (its --internal-token-file), if any."""
        self._metadata = bearer_metadata(token)
        # Fast reconnect: a restarted worker is noticed within a second, not gRPC's 120 s backoff.
        # tls_server_name: a worker found through DNS is dialled by IP; its certificate names the DNS name.
        options = channel_options(max_message_mb, fast_reconnect=True, tls_server_name=tls_server_name)
        self.address = address
        self.tls_server_name = tls_server_name  # a decode worker dials this one by the same name
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    async def info(self, timeout_s: float | None = None, wait_for_ready: bool = False) -> WorkerInfo:
        """Raises WorkerCallFailed."""
        try:
            reply = await self.stub.Info(
                worker_pb2.InfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None
        return info_from_proto(self.address, reply)

    def open_step_stream(self) -> grpc.aio.StreamStreamCall:
        """A StepStream call (engine/step_stream.py sends and reads it)."""
        return self.stub.StepStream(metadata=self._metadata)

    async def step_masks(self, step_id: int, masks: PlanMasks, timeout_s: float | None = None) -> None:
        """The late masks of step `step_id` (its mask_follows rows). Raises WorkerCallFailed."""
        request = worker_pb2.StepMasksRequest(step_id=step_id, masks=masks_to_proto(masks))
        try:
            await self.stub.StepMasks(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None

    async def load_adapter(self, slot: int, name: str, files: Mapping[str, bytes], timeout_s: float) -> None:
        """Place an adapter's files in a slot (never while a step runs: the core calls this
        with nothing in flight). Raises WorkerCallFailed (not transient: the worker refused
        the adapter, naming why)."""
        request = worker_pb2.LoadAdapterRequest(slot=slot, name=name, files=worker_pb2.LoraAdapterFiles(files=files))
        try:
            await self.stub.LoadAdapter(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None

    async def fetch_blocks(
        self,
        transfer_id: int,
        source: WorkerInfo,
        instance_id: str,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        source_tls_server_name: str = "",
    ) -> TransferResult:
        """Have this worker (instance `instance_id`) pull `source`'s blocks src_block_ids into
        its dst_block_ids; source_tls_server_name: the name `source`'s certificate carries,
        if not its host. Raises WorkerCallFailed."""
        request = worker_pb2.FetchBlocksRequest(
            transfer_id=transfer_id,
            source=source.address,
            source_instance_id=source.instance_id,
            instance_id=instance_id,
            src_block_ids=src_block_ids,
            dst_block_ids=dst_block_ids,
            source_tls_server_name=source_tls_server_name,
        )
        try:
            reply = await self.stub.FetchBlocks(request, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None
        return TransferResult(reply.blocks, reply.bytes, reply.read_ms, reply.write_ms)

    def failure(self, err: grpc.aio.AioRpcError) -> WorkerCallFailed:
        return call_failed(self.address, err.code().name, err.details() or "")

    async def close(self) -> None:
        await self.channel.close()
