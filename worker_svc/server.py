"""worker.v1 gRPC server. The only place that converts worker protos to and from
plain data."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import worker_pb2, worker_pb2_grpc
from svc_common.grpc_options import server_options
from svc_common.peer_auth import peer_interceptors, read_token_file
from svc_common.ready_file import write_ready_file
from svc_common.tls import channel_credentials, server_credentials
from worker_svc.config import WorkerConfig
from worker_svc.kv_transfer.chunk import Chunk, TransferFailed
from worker_svc.kv_transfer.codec import BlockCodec
from worker_svc.kv_transfer.mover import BlockMover, FetchOrder
from worker_svc.kv_transfer.transport import GrpcBlockSource, encode_chunk
from worker_svc.lora import AdapterRefused
from worker_svc.step.errors import InvalidStep, StaleStep, StepOutOfMemory, WorkerDown
from worker_svc.step.input import (
    BoolArray,
    Penalties,
    RowExtras,
    SamplingColumns,
    SeqColumns,
    StepInput,
    TierCopies,
    TokenMasks,
)
from worker_svc.step.output import StepOutput
from worker_svc.step.validation import check_columns, check_mask_shape
from worker_svc.worker import Worker

log = structlog.get_logger(__name__)
T = TypeVar("T")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A block move that takes longer than this has a source that stopped answering.
_TRANSFER_TIMEOUT_S = 60.0


# Per-row columns (seq_ids sets the row count); the flat ones are checked against their counts.
_PER_ROW = ("start_pos", "num_tokens", "table_lens", "flags", "temperature", "top_p", "top_k", "seeds")
# Per-row columns added since: absent (a scheduler that predates them) means 0 on every row.
_LATER_PER_ROW = ("min_p", "num_drafts", "pooling", "lora_slots")
_KNOWN_FLAGS = sum(worker_pb2.SeqFlag.values())  # the bits are distinct powers of two
_SAMPLE = worker_pb2.SEQ_FLAG_SAMPLE
_FROM_PREVIOUS = worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP
_RETURN_LOGITS = worker_pb2.SEQ_FLAG_RETURN_LOGITS
_SEEDED = worker_pb2.SEQ_FLAG_SEEDED
_MASK_FOLLOWS = worker_pb2.SEQ_FLAG_MASK_FOLLOWS


def step_from_proto(req: worker_pb2.StepRequest) -> StepInput:
    """One numpy array per column (numpy copies a packed repeated field in one
    go), their shapes checked before any is read; the step stays columns. Only
    the rows with extras get an object (RowExtras)."""
    c = req.seqs
    num_tokens, table_lens, flags = (np.array(x, np.int64) for x in (c.num_tokens, c.table_lens, c.flags))
    token_ids, slot_mapping, block_tables = (
        np.array(x, np.int64) for x in (c.token_ids, c.slot_mapping, c.block_tables)
    )
    rows = len(c.seq_ids)
    check_columns(
        rows,
        {name: len(getattr(c, name)) for name in _PER_ROW}
        | {name: len(getattr(c, name)) or rows for name in _LATER_PER_ROW},
        {
            "token_ids": (len(token_ids), "num_tokens", num_tokens),
            "slot_mapping": (len(slot_mapping), "num_tokens", num_tokens),
            "block_tables": (len(block_tables), "table_lens", table_lens),
        },
        flags,
        _KNOWN_FLAGS,
        c.extras.keys(),
    )
    sample, from_previous, return_logits, seeded, mask_follows = (
        (flags & bit) != 0 for bit in (_SAMPLE, _FROM_PREVIOUS, _RETURN_LOGITS, _SEEDED, _MASK_FOLLOWS)
    )
    temperature, top_p = np.array(c.temperature, np.float32), np.array(c.top_p, np.float32)
    min_p = np.array(c.min_p, np.float32) if len(c.min_p) else np.zeros(rows, np.float32)
    top_k, seeds = np.array(c.top_k, np.int64), np.array(c.seeds, np.uint64)
    sampling = SamplingColumns(temperature, top_p, top_k, seeds, seeded, min_p)
    seqs = SeqColumns(
        seq_ids=np.array(c.seq_ids, dtype=np.uint64),
        start_pos=np.array(c.start_pos, dtype=np.int64),
        num_tokens=num_tokens,
        table_lens=table_lens,
        sample=sample,
        from_previous=from_previous,
        return_logits=return_logits,
        sampling=sampling,
        token_ids=token_ids,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        extras={row: _extras(more, from_previous, row) for row, more in c.extras.items()},
        num_drafts=np.array(c.num_drafts, np.int64),
        masks=masks_from_proto("seqs.masks", c.masks) if c.HasField("masks") else None,
        draft_masks=masks_from_proto("seqs.draft_masks", c.draft_masks) if c.HasField("draft_masks") else None,
        late_mask_rows=np.flatnonzero(mask_follows),
        pooling=np.array(c.pooling, np.int64),
        lora_slots=np.array(c.lora_slots, np.int64),
    )
    copies = np.array([(copy.src, copy.dst) for copy in req.copies], dtype=np.int64).reshape(-1, 2)
    previous = req.previous_step_id if req.HasField("previous_step_id") else None
    late = (
        masks_from_proto("previous_step_masks", req.previous_step_masks)
        if req.HasField("previous_step_masks")
        else None
    )
    tiers = TierCopies(
        np.array([(c.src, c.dst) for c in req.offloads], dtype=np.int64).reshape(-1, 2),
        np.array([(c.src, c.dst) for c in req.onloads], dtype=np.int64).reshape(-1, 2),
    )
    return StepInput(req.step_id, copies, seqs, previous, late, tiers)


def masks_from_proto(field_name: str, m: worker_pb2.TokenMasks) -> TokenMasks:
    """The words as one [rows, W] int32 array read straight from the bytes (one copy, no varints)."""
    check_mask_shape(field_name, len(m.rows), m.width_words, len(m.words))
    words = np.frombuffer(m.words, dtype="<i4").astype(np.int32).reshape(len(m.rows), m.width_words)
    return TokenMasks(np.array(m.rows, dtype=np.int64), words)


def _extras(extras: worker_pb2.SeqExtras, from_previous: BoolArray, row: int) -> RowExtras:
    penalties = None
    if extras.HasField("penalties"):
        p = extras.penalties
        penalties = Penalties(
            p.presence,
            p.frequency,
            p.repetition,
            _plain(p.output_token_ids),
            _plain(p.prompt_token_ids),
            bool(from_previous[row]),
        )
    return RowExtras(
        extras.top_logprobs,
        _plain(extras.blocked_token_ids),
        _plain(extras.logit_bias_token_ids),
        _plain(extras.logit_bias_values),
        penalties,
        _plain(extras.prompt_logprob_targets),
        extras.prompt_top_logprobs,
    )


def _plain(field: Sequence[T]) -> tuple[T, ...]:
    """A repeated field as a tuple: the step stays plain data (a tensor-parallel
    worker pickles it to its other ranks) and outlives the request message."""
    return tuple(field) if field else ()


def step_to_proto(out: StepOutput, instance_id: str) -> worker_pb2.StepResponse:
    """The samples as columns; alternatives and logits rows only for the rows that asked."""
    rows = out.samples
    top_counts = [0] * len(rows)
    for i, block in rows.top.items():
        top_counts[i] = len(block)
    tops = [rows.top[i] for i in sorted(rows.top)]
    top = np.concatenate(tops) if tops else np.zeros((0, 2))
    sampled = worker_pb2.SampledColumns(
        seq_ids=rows.seq_ids.tolist(),
        token_ids=rows.token_ids.tolist(),
        logprobs=rows.logprobs.tolist(),
        top_counts=top_counts,
        top_token_ids=top[:, 0].astype(np.int64).tolist(),
        top_logprobs=top[:, 1].tolist(),
        logits={row: t.float().numpy().astype("<f4").tobytes() for row, t in rows.logits.items()},
        num_accepted=rows.num_accepted.tolist(),
        draft_logprobs=rows.draft_logprobs.tolist(),
    )
    prompt_logprobs = [
        worker_pb2.PromptLogprobs(
            seq_id=p.seq_id,
            logprobs=p.logprobs.tolist(),
            top_token_ids=p.top_token_ids.tolist(),
            top_logprobs=p.top_logprobs.tolist(),
        )
        for p in out.prompt_logprobs
    ]
    t = out.timings_ms
    timings = worker_pb2.StepTimings(
        prepare_ms=t.get("prepare_ms", 0.0),
        forward_ms=t.get("forward_ms", 0.0),
        sample_ms=t.get("sample_ms", 0.0),
        total_ms=t.get("total_ms", 0.0),
        offload_ms=t.get("offload_ms", 0.0),
        onload_ms=t.get("onload_ms", 0.0),
    )
    reply = worker_pb2.StepResponse(
        step_id=out.step_id,
        sampled=sampled,
        timings=timings,
        instance_id=instance_id,
        num_tokens=out.num_tokens,
        prompt_logprobs=prompt_logprobs,
    )
    if out.pooled is not None:
        values = out.pooled.values
        reply.pooled.seq_ids.extend(out.pooled.seq_ids.tolist())
        reply.pooled.hidden_size = values.shape[1]
        reply.pooled.values = values.astype("<f4", copy=False).tobytes()
    return reply


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker, mover: BlockMover):
        self.worker = worker
        self.mover = mover

    def FetchBlocks(
        self, request: worker_pb2.FetchBlocksRequest, context: grpc.ServicerContext
    ) -> worker_pb2.FetchBlocksResponse:
        order = FetchOrder(
            request.transfer_id,
            request.source,
            request.source_instance_id,
            request.instance_id,
            list(request.src_block_ids),
            list(request.dst_block_ids),
            request.source_tls_server_name,
        )
        try:
            done = self.mover.fetch(order)
        except InvalidStep as exc:
            log.warning("block fetch rejected", transfer_id=request.transfer_id, error=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferFailed as exc:  # the source, not this worker: the scheduler recomputes
            log.warning("block fetch failed", transfer_id=request.transfer_id, error=str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return worker_pb2.FetchBlocksResponse(
            transfer_id=request.transfer_id,
            blocks=done.blocks,
            bytes=done.bytes,
            read_ms=done.read_ms,
            write_ms=done.write_ms,
        )

    def ReadBlocks(self, request: worker_pb2.ReadBlocksRequest, context: grpc.ServicerContext) -> Iterator[Chunk]:
        try:
            chunks = self.mover.serve(list(request.block_ids), request.instance_id, request.direct_secret)
        except InvalidStep as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TransferFailed as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        try:
            yield from chunks  # serialized by encode_chunk (see serve())
        except (TransferFailed, OSError) as exc:  # a direct read's reader never came, or went away
            log.warning("blocks not sent", transfer_id=request.transfer_id, error=str(exc))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"sending blocks: {exc}")

    def StepMasks(
        self, request: worker_pb2.StepMasksRequest, context: grpc.ServicerContext
    ) -> worker_pb2.StepMasksResponse:
        try:
            self.worker.deliver_masks(request.step_id, masks_from_proto("step_masks.masks", request.masks))
        except InvalidStep as exc:
            log.warning("step masks rejected", step_id=request.step_id, error=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return worker_pb2.StepMasksResponse()

    def LoadAdapter(
        self, request: worker_pb2.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.LoadAdapterResponse:
        start = time.perf_counter()
        source = request.WhichOneof("source")
        try:
            if source is None:
                raise AdapterRefused("source", "set path (a PEFT adapter directory) or files")
            files = dict(request.files.files) if source == "files" else Path(request.path)
            adapter = self.worker.load_adapter(request.slot, request.name, files)
        except AdapterRefused as exc:
            log.warning("adapter refused", slot=request.slot, adapter=request.name, error=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"adapter {request.name!r}: {exc}")
        load_ms = (time.perf_counter() - start) * 1e3
        log.info("adapter loaded", slot=request.slot, adapter=request.name, rank=adapter.rank, ms=round(load_ms, 1))
        return worker_pb2.LoadAdapterResponse(rank=adapter.rank, target_modules=adapter.target_modules, load_ms=load_ms)

    def UnloadAdapter(
        self, request: worker_pb2.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> worker_pb2.UnloadAdapterResponse:
        try:
            self.worker.unload_adapter(request.slot)
        except AdapterRefused as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        log.info("adapter unloaded", slot=request.slot)
        return worker_pb2.UnloadAdapterResponse()

    def Info(self, request: worker_pb2.InfoRequest, context: grpc.ServicerContext) -> worker_pb2.InfoResponse:
        return worker_pb2.InfoResponse(**dataclasses.asdict(self.worker.info))

    def Step(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext) -> worker_pb2.StepResponse:
        step_log = log.bind(step_id=request.step_id)
        try:
            out = self.worker.step(step_from_proto(request))
        except InvalidStep as exc:
            step_log.warning("step rejected", error=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StaleStep as exc:
            step_log.warning("step refused", error=str(exc))
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except StepOutOfMemory as exc:
            step_log.warning(
                "step ran out of device memory: refused, the worker serves on", error=str(exc), fatal=False
            )
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"step out of device memory: {exc}")
        except WorkerDown as exc:  # a rank gone, a CUDA error: the scheduler treats it as a dead worker
            step_log.error("step failed: worker going down", error=str(exc), fatal=True)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker going down: {exc}")
        except Exception as exc:  # a bug must not take the worker down
            step_log.exception("step failed: the worker serves on", fatal=False)
            context.abort(grpc.StatusCode.INTERNAL, f"step failed: {type(exc).__name__}: {exc}")
        step_log.debug("step done", seqs=len(request.seqs.seq_ids), tokens=out.num_tokens, **out.timings_ms)
        return step_to_proto(out, self.worker.info.instance_id)


@dataclass
class WorkerServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int

    def shutdown(self, grace_s: float) -> None:
        """Health NOT_SERVING, refuse new calls, let the step in flight finish (up to grace_s)."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()

    def not_serving(self) -> None:
        """Health NOT_SERVING at once (the worker is going down), calls still answered."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def _log_refusal(method: str, why: str) -> None:
    log.warning("call refused", method=method, reason=why)


def block_mover(worker: Worker, config: WorkerConfig) -> BlockMover:
    """Both ends of a block move (disaggregation); the blocks are pulled from their source
    with this worker's own credentials: the internal token, and with TLS its certificate,
    trusting the CA that signs the deployment's certificates (--tls-client-ca)."""
    token = read_token_file(config.internal_token_file) if config.internal_token_file else None
    credentials = None
    if config.tls_cert:
        credentials = channel_credentials(config.tls_client_ca, config.tls_cert, config.tls_key)
    source = GrpcBlockSource(token, credentials, config.max_message_mb, _TRANSFER_TIMEOUT_S)
    refusal = None
    if worker.parallel is not None or worker.cache.layout != "paged":
        refusal = "this worker's blocks cannot move: a tensor-parallel or contiguous cache (its --kv-role is both)"
    codec = BlockCodec(worker.cache.tensors)
    return BlockMover(codec, worker.info.instance_id, source, refusal, config.host, _TRANSFER_TIMEOUT_S)


def serve(worker: Worker, config: WorkerConfig) -> WorkerServer:
    # Only the scheduler (the holder of the internal token, or of a client certificate) may call.
    interceptors = peer_interceptors(config.internal_token_file, config.tls_client_names, _log_refusal)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=server_options(config.max_message_mb),
        interceptors=interceptors,
    )
    servicer = WorkerServicer(worker, block_mover(worker, config))
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    # ReadBlocks' chunks go out as BlocksChunk bytes built around the blocks' bytes in one
    # copy (kv_transfer/transport.py): this handler replaces the generated one.
    read_blocks = grpc.unary_stream_rpc_method_handler(
        servicer.ReadBlocks,
        request_deserializer=worker_pb2.ReadBlocksRequest.FromString,
        response_serializer=encode_chunk,
    )
    server.add_registered_method_handlers(SERVICE_NAME, {"ReadBlocks": read_blocks})
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}")
    server.start()
    log.info(
        "worker ready",
        host=config.host,
        port=bound,
        tls=bool(credentials),
        mutual_tls=bool(config.tls_client_ca),
        internal_token=bool(config.internal_token_file),
        client_names=config.tls_client_names or "any the CA signed",
        **dataclasses.asdict(worker.info),
        **({"rank_pids": worker.parallel.pids} if worker.parallel else {}),
    )
    if not (config.internal_token_file or config.tls_client_ca):
        log.warning("no --internal-token-file or --tls-client-ca: any local process can run steps", host=config.host)
    write_ready_file(config.ready_file, config.host, bound)
    return WorkerServer(server, health_servicer, bound)
