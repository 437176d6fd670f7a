"""serving.v1 gRPC front end. The only place that converts serving protos to and
from the engine's data classes, and engine errors to gRPC status codes."""
from __future__ import annotations

import dataclasses
import math
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.engine.engine import Engine, EngineStats
from scheduler_svc.api.status import DOMAIN_ERRORS, abort_with
from scheduler_svc.engine.streams import StreamEvent
from scheduler_svc.engine.pinning import pin_on_core
from scheduler_svc.planning.planner import RequestRejected
from scheduler_svc.request import Request, SamplingOptions

log = structlog.get_logger(__name__)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_SAMPLES = 16
_SEED_SPACE = 2**64


def prompt_from_proto(msg, engine: Engine) -> list[int]:
    """Token ids of a message with `prompt` / `prompt_token_ids` (exactly one)."""
    has_text, has_ids = bool(msg.prompt), bool(msg.prompt_token_ids)
    if has_text == has_ids:
        raise RequestRejected("prompt", "give exactly one of prompt (non-empty text) and prompt_token_ids")
    vocab = engine.tokenizer.vocab_size
    if has_ids:
        bad = next((t for t in msg.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        return list(msg.prompt_token_ids)
    prompt_ids = engine.tokenizer.encode(msg.prompt)
    if not prompt_ids:
        raise RequestRejected("prompt", "the prompt encodes to no tokens")
    return prompt_ids


def request_from_proto(msg: serving_pb2.GenerateRequest, engine: Engine, default_max_tokens: int) -> Request:
    """Validate and convert; raises RequestRejected naming the field. With n > 1,
    returns a prefill-only parent whose children are the n samples."""
    prompt_ids = prompt_from_proto(msg, engine)
    sampling = _sampling_from_proto(msg, default_max_tokens)
    n = msg.n if msg.HasField("n") else 1
    if not 1 <= n <= MAX_SAMPLES:
        raise RequestRejected("n", f"must be in [1, {MAX_SAMPLES}], got {n}")
    if n > 1 and len(prompt_ids) < 2:
        raise RequestRejected("n", "parallel samples need a prompt of at least 2 tokens (they fork after its "
                                   "second-to-last token)")
    request_id = msg.request_id or uuid.uuid4().hex
    common = dict(eos_token_ids=engine.tokenizer.eos_token_ids, cache_salt=msg.cache_salt or None)
    if n == 1:
        return Request(request_id, engine.next_seq_id(), prompt_ids, sampling, **common)
    children = [Request(f"{request_id}/{i}", engine.next_seq_id(), prompt_ids, _sample_seed(sampling, i),
                        sample_index=i, **common) for i in range(n)]
    return Request(request_id, engine.next_seq_id(), prompt_ids[:-1], sampling, prefill_only=True,
                   children=children, **common)


def _sample_seed(sampling: SamplingOptions, index: int) -> SamplingOptions:
    if sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) % _SEED_SPACE)


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
                                         finish_reason=event.finish_reason, index=event.index)
    if event.progress is not None:
        reply.prefill_progress.processed_tokens, reply.prefill_progress.total_tokens = event.progress
    if event.usage is not None:
        u = event.usage
        reply.usage.CopyFrom(serving_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                               cached_prompt_tokens=u.cached_prompt_tokens))
    return reply


def stats_to_proto(stats: EngineStats, extra: dict[str, Any]) -> serving_pb2.StatsResponse:
    return serving_pb2.StatsResponse(**dataclasses.asdict(stats), **extra)


# The observability layer's Stats fields (numbers >= 30); the API only forwards them.
ExtraStats = Callable[[], dict[str, Any]]


class SchedulerServicer(serving_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine, default_max_tokens: int, extra_stats: ExtraStats = dict):
        self.engine = engine
        self.default_max_tokens = default_max_tokens
        self.extra_stats = extra_stats

    async def Generate(self, request, context):
        try:
            req = request_from_proto(request, self.engine, self.default_max_tokens)
            stream = self.engine.submit(req)
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        log.info("request received", request_id=req.request_id, prompt_tokens=req.num_prompt_tokens,
                 max_tokens=req.sampling.max_tokens, n=stream.num_samples)
        try:
            remaining = stream.num_samples
            while remaining:
                event = await stream.events.get()
                if event.error_code:
                    await context.abort(grpc.StatusCode[event.error_code], event.error_message)
                yield event_to_proto(event, req.request_id)
                remaining -= event.finished
        finally:
            # Runs on normal end, client cancel and deadline alike: a request whose
            # client is gone is aborted and its blocks freed within one step.
            self.engine.release(req.request_id)

    async def Stats(self, request, context):
        return stats_to_proto(self.engine.stats(), self.extra_stats())

    async def PinPrefix(self, request, context):
        try:
            prompt_ids = prompt_from_proto(request, self.engine)
            if len(prompt_ids) < self.engine.block_size:
                raise RequestRejected("prompt", f"a pinned prefix needs at least one full block "
                                                f"({self.engine.block_size} tokens), got {len(prompt_ids)}")
            pins = [await pin_on_core(core, prompt_ids, request.cache_salt or None, self.engine.next_seq_id())
                    for core in self.engine.serving_cores()]
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        pinned = [p for p in pins if p is not None]
        if not pinned:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker could keep the prefix cached long "
                                                             "enough to pin it (memory pressure)")
        pin_id, tokens = pinned[0]
        log.info("prefix pinned", pin_id=pin_id.hex(), tokens=tokens, workers=len(pinned))
        return serving_pb2.PinPrefixResponse(pin_id=pin_id.hex(), pinned_tokens=tokens, workers=len(pinned))

    async def UnpinPrefix(self, request, context):
        try:
            pin_id = bytes.fromhex(request.pin_id)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pin_id: not a pin id: {request.pin_id!r}")
        unpinned = [core.planner.kv.unpin(pin_id) for core in self.engine.cores]
        return serving_pb2.UnpinPrefixResponse(unpinned=any(unpinned))
