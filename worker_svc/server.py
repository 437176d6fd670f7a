"""worker.v1 gRPC server: the services' calls, their status codes, and serving them
(the Step messages' conversions are step_proto.py's; the Step calls step_rpc.py's)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
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
from worker_svc.step.errors import InvalidStep
from worker_svc.step_proto import masks_from_proto
from worker_svc.step_rpc import StepCalls
from worker_svc.worker import Worker

log = structlog.get_logger(__name__)
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
# A block move that takes longer than this has a source that stopped answering.
_TRANSFER_TIMEOUT_S = 60.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker, mover: BlockMover):
        self.worker = worker
        self.mover = mover
        self.steps = StepCalls(worker)

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
        return self.steps.unary(request, context)

    def StepStream(
        self, request_iterator: Iterator[worker_pb2.StepRequest], context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.StepReply]:
        return self.steps.stream(request_iterator)


@dataclass
class WorkerServer:
    server: grpc.Server
    health: health.HealthServicer
    port: int
    steps: StepCalls

    def shutdown(self, grace_s: float) -> None:
        """Health NOT_SERVING, refuse new calls and a stream's next step, let the step in
        flight finish (up to grace_s)."""
        self.steps.stop()
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
    return WorkerServer(server, health_servicer, bound, servicer.steps)
