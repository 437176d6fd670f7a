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
from worker_svc.step_input import (
    InvalidStep,
    Penalties,
    Sampling,
    SeqInput,
    StaleStep,
    StepArrays,
    StepInput,
    check_columns,
)
from worker_svc.worker import Worker

log = structlog.get_logger(__name__)
T = TypeVar("T")
SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


# Per-row columns (seq_ids sets the row count); the flat ones are checked against their counts.
_PER_ROW = ("start_pos", "num_tokens", "table_lens", "flags", "temperature", "top_p", "top_k", "seeds")
_KNOWN_FLAGS = sum(worker_pb2.SeqFlag.values())  # the bits are distinct powers of two
_SAMPLE = worker_pb2.SEQ_FLAG_SAMPLE
_FROM_PREVIOUS = worker_pb2.SEQ_FLAG_TOKEN_FROM_PREVIOUS_STEP
_RETURN_LOGITS = worker_pb2.SEQ_FLAG_RETURN_LOGITS
_SEEDED = worker_pb2.SEQ_FLAG_SEEDED


def step_from_proto(req: worker_pb2.StepRequest) -> StepInput:
    """One numpy array per column (numpy copies a packed repeated field in one
    go), their shapes checked before any is sliced; each SeqInput views its
    row's slices. Rows without extras share their Sampling."""
    c = req.seqs
    i64 = lambda column: np.array(column, dtype=np.int64)
    num_tokens, table_lens, flags = i64(c.num_tokens), i64(c.table_lens), i64(c.flags)
    token_ids, slot_mapping, block_tables = i64(c.token_ids), i64(c.slot_mapping), i64(c.block_tables)
    check_columns(
        len(c.seq_ids),
        {name: len(getattr(c, name)) for name in _PER_ROW},
        {
            "token_ids": (len(token_ids), "num_tokens", num_tokens),
            "slot_mapping": (len(slot_mapping), "num_tokens", num_tokens),
            "block_tables": (len(block_tables), "table_lens", table_lens),
        },
        flags,
        _KNOWN_FLAGS,
        c.extras.keys(),
    )
    arrays = StepArrays(token_ids, num_tokens, i64(c.start_pos), slot_mapping, num_tokens, block_tables, table_lens)
    extras = dict(c.extras.items())
    token_bounds = _bounds(num_tokens)
    bit = lambda flag: ((flags & flag) != 0).tolist()
    seqs = [
        SeqInput(seq_id, tokens, start, table, slots, sample, sampling, return_logits, from_previous)
        for seq_id, tokens, start, table, slots, sample, sampling, return_logits, from_previous in zip(
            c.seq_ids,
            _slices(token_ids, token_bounds),
            arrays.start_pos.tolist(),
            _slices(block_tables, _bounds(table_lens)),
            _slices(slot_mapping, token_bounds),
            bit(_SAMPLE),
            _samplings(c, flags, extras),
            bit(_RETURN_LOGITS),
            bit(_FROM_PREVIOUS),
        )
    ]
    for row, more in extras.items():
        seqs[row].prompt_logprob_targets = _plain(more.prompt_logprob_targets)
        seqs[row].prompt_top_logprobs = more.prompt_top_logprobs
    previous = req.previous_step_id if req.HasField("previous_step_id") else None
    return StepInput(req.step_id, [(copy.src, copy.dst) for copy in req.copies], seqs, arrays, previous)


def _bounds(lens: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each row's slice of a flat column."""
    ends = np.cumsum(lens)
    return list(zip((ends - lens).tolist(), ends.tolist()))


def _slices(flat: np.ndarray, bounds: list[tuple[int, int]]) -> list[np.ndarray]:
    return [flat[start:end] for start, end in bounds]


def _samplings(c: worker_pb2.SeqColumns, flags: np.ndarray, extras: dict[int, worker_pb2.SeqExtras]) -> list[Sampling]:
    """Each row's Sampling: equal plain rows share one; a row with extras gets its own."""
    seeds = np.array(c.seeds, dtype=np.uint64).tolist()
    keys = list(
        zip(
            np.array(c.temperature, dtype=np.float32).tolist(),
            np.array(c.top_p, dtype=np.float32).tolist(),
            np.array(c.top_k, dtype=np.int64).tolist(),
            [seed if seeded else None for seed, seeded in zip(seeds, ((flags & _SEEDED) != 0).tolist())],
        )
    )
    plain = {key: Sampling(*key) for key in set(keys)}
    out = [plain[key] for key in keys]
    for row, more in extras.items():
        out[row] = _sampling(*keys[row], more, bool(flags[row] & _FROM_PREVIOUS))
    return out


def _sampling(
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    extras: worker_pb2.SeqExtras,
    input_is_previous_sample: bool,
) -> Sampling:
    penalties = None
    if extras.HasField("penalties"):
        p = extras.penalties
        penalties = Penalties(
            p.presence,
            p.frequency,
            p.repetition,
            _plain(p.output_token_ids),
            _plain(p.prompt_token_ids),
            input_is_previous_sample,
        )
    return Sampling(
        temperature,
        top_p,
        top_k,
        seed,
        extras.top_logprobs,
        _plain(extras.blocked_token_ids),
        _plain(extras.logit_bias_token_ids),
        _plain(extras.logit_bias_values),
        penalties,
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
