"""serving.v1 Embed: a prompt's pooled hidden state, run as a prefill-only request
through the same planner and steps as generation (planning/pooling.py)."""

from __future__ import annotations

import dataclasses
import uuid

from proto import serving_pb2
from scheduler_svc.api.prompt import prompt_from_proto
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.errors import WorkerUnavailable
from scheduler_svc.planning.pooling import check_dimensions
from scheduler_svc.planning.validation import RequestRejected, check_request_id
from scheduler_svc.request import PoolingKind, PoolingOptions, Request, SamplingOptions

# A pooling request generates nothing: no decode slot is ever allocated for it. A
# classifier's last chunk samples greedily (the cheapest draw) only to get its logits back.
_PREFILL_ONLY = SamplingOptions(max_tokens=0, temperature=0.0)


def hidden_size(engine: Engine) -> int:
    """The workers' hidden size (the pooled vector's length); 0 when none says."""
    return max((core.info.hidden_size for core in engine.cores), default=0)


async def embed_request(
    msg: serving_pb2.EmbedRequest, engine: Engine, model_pooling: PoolingOptions, max_chars: int
) -> Request:
    """Validated (RequestRejected naming the field) and tokenized."""
    check_request_id(msg.request_id)
    prompt_ids = await prompt_from_proto(msg, engine, max_chars)
    if len(prompt_ids) > engine.max_model_len:
        raise RequestRejected(
            "prompt",
            f"this model's maximum context length is {engine.max_model_len} tokens, got {len(prompt_ids)}",
        )
    dimensions = msg.dimensions if msg.HasField("dimensions") else None
    if msg.score and (dimensions is not None or msg.HasField("normalize")):
        raise RequestRejected("dimensions" if dimensions is not None else "normalize", "not with a score")
    check_dimensions(dimensions, hidden_size(engine))
    options = dataclasses.replace(model_pooling, dimensions=dimensions)
    if msg.HasField("normalize"):
        options = dataclasses.replace(options, normalize=msg.normalize)
    return Request(
        msg.request_id or uuid.uuid4().hex,
        engine.requests.next_seq_id(),
        prompt_ids,
        _PREFILL_ONLY,
        cache_salt=msg.cache_salt or None,
        priority=msg.priority,
        pooling=options,
    )


async def run_embed(engine: Engine, request: Request) -> serving_pb2.EmbedResponse:
    """Submit, wait for the finished event (progress events before it are skipped), answer.
    The caller releases the request whatever happens."""
    stream = engine.requests.submit(request)
    while True:
        event = await stream.events.get()
        if event.error is not None:
            raise event.error
        if event.finished:
            break
    if event.embedding is None:  # aborted (shutting down) before its prompt was computed
        raise WorkerUnavailable(f"{request.request_id}: ended ({event.finish_reason}) before its prompt was pooled")
    reply = serving_pb2.EmbedResponse(
        request_id=request.request_id,
        prompt_tokens=request.num_prompt_tokens,
        cached_prompt_tokens=request.num_cached_prompt_tokens,
    )
    if request.pooling is not None and request.pooling.kind is PoolingKind.CLASSIFY:
        [reply.score] = event.embedding
    else:
        reply.embedding.extend(event.embedding)
    return reply
