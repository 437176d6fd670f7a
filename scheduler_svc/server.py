"""serving.v1 gRPC front end. The only place that converts serving protos to and
from the engine's data classes, and engine errors to gRPC status codes."""
from __future__ import annotations

import math
import uuid

import grpc
import structlog

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.engine import Engine, EngineStats
from scheduler_svc.engine_core import WorkerUnavailable
from scheduler_svc.output import StreamEvent
from scheduler_svc.planner import QueueFull, RequestRejected
from scheduler_svc.request import Request, SamplingOptions

log = structlog.get_logger(__name__)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512


def request_from_proto(msg: serving_pb2.GenerateRequest, engine: Engine, default_max_tokens: int) -> Request:
    """Validate and convert; raises RequestRejected naming the field."""
    has_text, has_ids = bool(msg.prompt), bool(msg.prompt_token_ids)
    if has_text == has_ids:
        raise RequestRejected("prompt", "give exactly one of prompt (non-empty text) and prompt_token_ids")
    vocab = engine.tokenizer.vocab_size
    if has_ids:
        bad = next((t for t in msg.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        prompt_ids = list(msg.prompt_token_ids)
    else:
        prompt_ids = engine.tokenizer.encode(msg.prompt)
        if not prompt_ids:
            raise RequestRejected("prompt", "the prompt encodes to no tokens")
    return Request(
        request_id=msg.request_id or uuid.uuid4().hex,
        seq_id=engine.next_seq_id(),
        prompt_token_ids=prompt_ids,
        sampling=_sampling_from_proto(msg, default_max_tokens),
        eos_token_ids=engine.tokenizer.eos_token_ids,
    )


def _sampling_from_proto(msg: serving_pb2.GenerateRequest, default_max_tokens: int) -> SamplingOptions:
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens
    temperature = msg.temperature if msg.HasField("temperature") else 1.0
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if max_tokens <= 0:
        raise RequestRejected("max_tokens", f"must be > 0, got {max_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise RequestRejected("temperature", f"must be a finite number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestRejected("top_p", f"must be in (0, 1], got {top_p}")
    if msg.top_k < 0:
        raise RequestRejected("top_k", f"must be >= 0 (0 = off), got {msg.top_k}")
    stop = tuple(s for s in msg.stop if s)
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise RequestRejected("stop", f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_CHARS} characters")
    return SamplingOptions(temperature=temperature, top_p=top_p, top_k=msg.top_k,
                           seed=msg.seed if msg.HasField("seed") else None, max_tokens=max_tokens, stop=stop,
                           ignore_eos=msg.ignore_eos)


def event_to_proto(event: StreamEvent, request_id: str) -> serving_pb2.GenerateResponse:
    reply = serving_pb2.GenerateResponse(request_id=request_id, text=event.text, token_ids=event.token_ids,
                                         logprobs=event.logprobs, finished=event.finished,
                                         finish_reason=event.finish_reason)
    if event.progress is not None:
        reply.prefill_progress.processed_tokens, reply.prefill_progress.total_tokens = event.progress
    if event.usage is not None:
        u = event.usage
        reply.usage.CopyFrom(serving_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                               cached_prompt_tokens=u.cached_prompt_tokens))
    return reply


def stats_to_proto(stats: EngineStats) -> serving_pb2.StatsResponse:
    return serving_pb2.StatsResponse(**stats.__dict__)


class SchedulerServicer(serving_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, default_max_tokens: int):
        self.engine = engine
        self.default_max_tokens = default_max_tokens

    async def Generate(self, request, context):
        try:
            req = request_from_proto(request, self.engine, self.default_max_tokens)
            stream = self.engine.submit(req)
        except RequestRejected as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except WorkerUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("request received", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens,
                 max_tokens=req.sampling.max_tokens)
        try:
            while True:
                event = await stream.events.get()
                if event.error_code:
                    await context.abort(grpc.StatusCode[event.error_code], event.error_message)
                yield event_to_proto(event, req.request_id)
                if event.finished:
                    return
        finally:
            # Runs on normal end, client cancel and deadline alike: a request whose
            # client is gone is aborted and its blocks freed within one step.
            self.engine.release(req.request_id)

    async def Stats(self, request, context):
        return stats_to_proto(self.engine.stats())
