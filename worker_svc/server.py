"""worker.v1 gRPC server. The only place that converts worker protos to and from
plain data."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from proto import worker_pb2, worker_pb2_grpc
from svc_common.grpc_options import server_options
from svc_common.ready_file import write_ready_file
from svc_common.tls import server_credentials
from worker_svc.config import WorkerConfig
from worker_svc.model_runner import StepOutput
from worker_svc.parallel.group import WorkerDown
from worker_svc.step_input import InvalidStep, Penalties, Sampling, SeqInput, StaleStep, StepArrays, StepInput
from worker_svc.worker import Worker

log = structlog.get_logger(__name__)
T = TypeVar("T")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def step_from_proto(req: worker_pb2.StepRequest) -> StepInput:
    """The step's numbers go straight into flat arrays (one extend per field per
    sequence, then one numpy array each); each SeqInput views its slices."""
    tokens: list[int] = []
    slots: list[int] = []
    tables: list[int] = []
    seq_lens, slot_lens, table_lens, starts = [], [], [], []
    for s in req.seqs:
        tokens.extend(s.token_ids)
        slots.extend(s.slot_mapping)
        tables.extend(s.block_table)
        seq_lens.append(len(s.token_ids))
        slot_lens.append(len(s.slot_mapping))
        table_lens.append(len(s.block_table))
        starts.append(s.start_pos)
    i64 = lambda values: np.array(values, dtype=np.int64)
    arrays = StepArrays(
        i64(tokens), i64(seq_lens), i64(starts), i64(slots), i64(slot_lens), i64(tables), i64(table_lens)
    )
    views = zip(
        np.split(arrays.token_ids, np.cumsum(arrays.seq_lens)[:-1]),
        np.split(arrays.block_tables, np.cumsum(arrays.table_lens)[:-1]),
        np.split(arrays.slot_mapping, np.cumsum(arrays.slot_lens)[:-1]),
    )
    seqs = [
        SeqInput(
            s.seq_id,
            token_ids,
            s.start_pos,
            table,
            slot_mapping,
            s.sample,
            _sampling(s.sampling, s.token_from_previous_step),
            s.return_logits,
            s.token_from_previous_step,
            _plain(s.prompt_logprob_targets),
            s.prompt_top_logprobs,
        )
        for s, (token_ids, table, slot_mapping) in zip(req.seqs, views)
    ]
    previous = req.previous_step_id if req.HasField("previous_step_id") else None
    return StepInput(req.step_id, [(c.src, c.dst) for c in req.copies], seqs, arrays, previous)


def _sampling(sp: worker_pb2.SamplingParams, input_is_previous_sample: bool) -> Sampling:
    penalties = None
    if sp.HasField("penalties"):
        p = sp.penalties
        penalties = Penalties(
            p.presence,
            p.frequency,
            p.repetition,
            _plain(p.output_token_ids),
            _plain(p.prompt_token_ids),
            input_is_previous_sample,
        )
    return Sampling(
        sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.seed if sp.HasField("seed") else None,
        sp.top_logprobs,
        _plain(sp.blocked_token_ids),
        _plain(sp.logit_bias_token_ids),
        _plain(sp.logit_bias_values),
        penalties,
    )


def _plain(field: Sequence[T]) -> tuple[T, ...]:
    """A repeated field as a tuple: the step stays plain data (a tensor-parallel
    worker pickles it to its other ranks) and outlives the request message."""
    return tuple(field) if field else ()


def step_to_proto(out: StepOutput, instance_id: str) -> worker_pb2.StepResponse:
    sampled = [
        worker_pb2.SampledToken(
            seq_id=t.seq_id,
            token_id=t.token_id,
            logprob=t.logprob,
            logits=t.logits.float().numpy().astype("<f4").tobytes() if t.logits is not None else b"",
            top_token_ids=t.top_token_ids,
            top_logprobs=t.top_logprobs,
        )
        for t in out.sampled
    ]
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
    )
    return worker_pb2.StepResponse(
        step_id=out.step_id,
        sampled=sampled,
        timings=timings,
        instance_id=instance_id,
        num_tokens=out.num_tokens,
        prompt_logprobs=prompt_logprobs,
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker: Worker):
        self.worker = worker

    def Info(self, request, context):
        return worker_pb2.InfoResponse(**dataclasses.asdict(self.worker.info))

    def Step(self, request, context):
        step_log = log.bind(step_id=request.step_id)
        try:
            out = self.worker.step(step_from_proto(request))
        except InvalidStep as exc:
            step_log.warning("step rejected", error=str(exc))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except StaleStep as exc:
            step_log.warning("step refused", error=str(exc))
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        except WorkerDown as exc:  # a tensor-parallel rank is gone: the scheduler treats it as a dead worker
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker going down: {exc}")
        except Exception as exc:  # a bug must not take the worker down
            step_log.exception("step failed")
            context.abort(grpc.StatusCode.INTERNAL, f"step failed: {type(exc).__name__}: {exc}")
        step_log.debug("step done", seqs=len(request.seqs), tokens=out.num_tokens, **out.timings_ms)
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


def serve(worker: Worker, config: WorkerConfig) -> WorkerServer:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=server_options(config.max_message_mb))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(worker), server)
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
        **dataclasses.asdict(worker.info),
        **({"rank_pids": worker.parallel.pids} if worker.parallel else {}),
    )
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.tls_client_ca:
        log.warning(
            "listening beyond loopback without mutual TLS: anyone who can connect can run steps", host=config.host
        )
    write_ready_file(config.ready_file, config.host, bound)
    return WorkerServer(server, health_servicer, bound)
