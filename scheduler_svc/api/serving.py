"""serving.v1 gRPC front end: the servicer, and the engine's events and stats as protos.
Requests come in through prompt, generate_request and embed (this package: the only
place serving protos meet the engine's data classes); engine errors leave as gRPC status
codes through status."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog

from proto import serving_pb2, serving_pb2_grpc
from scheduler_svc.api.embed import embed_request, run_embed
from scheduler_svc.api.generate_request import attach_grammar, request_from_proto
from scheduler_svc.api.prompt import prompt_from_proto
from scheduler_svc.api.status import DOMAIN_ERRORS, abort, abort_with
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.pinning import PinLedger, pin_on_core
from scheduler_svc.engine.stats import EngineStats, engine_stats
from scheduler_svc.engine.streams import StreamEvent, coalesce
from scheduler_svc.planning.validation import (
    RequestRejected,
    check_in_vocab,
    check_prompt_chars,
    check_request_id,
)
from scheduler_svc.request import PoolingKind, PoolingOptions, TokenLogprob
from scheduler_svc.text.tokenizer import ModelTokenizer
from svc_common.peer_auth import bearer_token

log = structlog.get_logger(__name__)


def event_to_proto(event: StreamEvent, request_id: str, tokenizer: ModelTokenizer) -> serving_pb2.GenerateResponse:
    reply = serving_pb2.GenerateResponse(
        request_id=request_id,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=event.logprobs,
        finished=event.finished,
        finish_reason=event.finish_reason,
        index=event.index,
    )
    if event.stop_string is not None:
        reply.stop_string = event.stop_string
    elif event.stop_token_id is not None:
        reply.stop_token_id = event.stop_token_id
    if event.top_logprobs:
        reply.token_logprobs.extend(
            _logprob_to_proto(TokenLogprob(token_id, logprob, top), tokenizer)
            for token_id, logprob, top in zip(event.token_ids, event.logprobs, event.top_logprobs)
        )
    if event.prompt_logprobs is not None:
        reply.prompt_logprobs.extend(_logprob_to_proto(t, tokenizer) for t in event.prompt_logprobs)
    if event.progress is not None:
        reply.prefill_progress.processed_tokens, reply.prefill_progress.total_tokens = event.progress
    if event.usage is not None:
        u = event.usage
        reply.usage.CopyFrom(
            serving_pb2.Usage(
                prompt_tokens=u.prompt_tokens,
                completion_tokens=u.completion_tokens,
                cached_prompt_tokens=u.cached_prompt_tokens,
            )
        )
    return reply


def _logprob_to_proto(t: TokenLogprob, tokenizer: ModelTokenizer) -> serving_pb2.TokenLogprob:
    top = [
        serving_pb2.TopLogprob(token_id=token_id, logprob=logprob, token=tokenizer.token_text(token_id))
        for token_id, logprob in t.top
    ]
    return serving_pb2.TokenLogprob(
        token_id=t.token_id, logprob=t.logprob, token=tokenizer.token_text(t.token_id), top=top
    )


def stats_to_proto(stats: EngineStats, extra: dict[str, Any]) -> serving_pb2.StatsResponse:
    return serving_pb2.StatsResponse(**dataclasses.asdict(stats), **extra)


# The observability layer's Stats fields (numbers >= 30); the API only forwards them.
ExtraStats = Callable[[], dict[str, Any]]


# Embed's `score` against what the pooling scheduler serves (indexed by: it is a classifier).
_SCORE_MISMATCH = {
    True: "score: this scheduler scores prompts (--classifier-from-token): it serves no embeddings",
    False: "score: this scheduler embeds; scores from token logits need --classifier-from-token",
}


class SchedulerServicer(serving_pb2_grpc.SchedulerServicer):
    def __init__(
        self,
        engine: Engine,
        default_max_tokens: int,
        extra_stats: ExtraStats = dict,
        max_prompt_chars: int = 0,
        pooling: PoolingOptions | None = None,
    ):
        """max_prompt_chars: the longest text prompt; 0 = what can fit the context. pooling:
        --runner pooling's model pooling (Embed served, Generate refused); None: the reverse."""
        self.engine = engine
        self.pooling = pooling
        self.default_max_tokens = default_max_tokens
        self.extra_stats = extra_stats
        self.max_prompt_chars = max_prompt_chars or engine.max_model_len * engine.tokenizer.longest_token_chars
        config = engine.fleet.config
        self.pins = PinLedger(config.max_pin_share_per_key, config.pin_ttl_s, self._unpin)

    def _unpin(self, pin_id: bytes) -> None:
        for core in self.engine.cores:
            core.planner.kv.unpin(pin_id)

    async def Generate(
        self, request: serving_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[serving_pb2.GenerateResponse]:
        if self.pooling is not None:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "this scheduler serves embeddings (--runner pooling)"
            )
        try:
            check_request_id(request.request_id)
            prompt_ids = await prompt_from_proto(request, self.engine, self.max_prompt_chars)
            req = request_from_proto(request, self.engine, self.default_max_tokens, prompt_ids)
            await attach_grammar(req, request, self.engine)
            stream = self.engine.requests.submit(req)
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        log.info(
            "request received",
            request_id=req.request_id,
            prompt_tokens=req.num_prompt_tokens,
            max_tokens=req.sampling.max_tokens,
            n=stream.num_samples,
        )
        try:
            remaining = stream.num_samples
            while remaining:
                event, error = await stream.events.get(), None
                if stream.num_samples == 1:
                    event, error = coalesce(stream.events, event)
                if event.error is not None:
                    await abort_with(context, event.error)
                yield event_to_proto(event, req.request_id, self.engine.tokenizer)
                remaining -= event.finished
                if error is not None and error.error is not None:  # after the tokens that came before it
                    await abort_with(context, error.error)
        finally:
            # Runs on normal end, client cancel and deadline alike: a request whose
            # client is gone is aborted and its blocks freed within one step.
            self.engine.requests.release(req.request_id)

    async def Embed(
        self, request: serving_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.EmbedResponse:
        if self.pooling is None:
            await abort(
                context, grpc.StatusCode.FAILED_PRECONDITION, "this scheduler generates: start it with --runner pooling"
            )
        try:
            classifier = self.pooling.kind is PoolingKind.CLASSIFY
            if request.score != classifier:
                await abort(context, grpc.StatusCode.FAILED_PRECONDITION, _SCORE_MISMATCH[classifier])
            req = await embed_request(request, self.engine, self.pooling, self.max_prompt_chars)
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        try:
            return await run_embed(self.engine, req)
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        finally:
            self.engine.requests.release(req.request_id)

    async def Stats(
        self, request: serving_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.StatsResponse:
        return stats_to_proto(engine_stats(self.engine.cores), self.extra_stats())

    async def PinPrefix(
        self, request: serving_pb2.PinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.PinPrefixResponse:
        try:
            prompt_ids = await prompt_from_proto(request, self.engine, self.max_prompt_chars)
            if len(prompt_ids) < self.engine.fleet.block_size:
                raise RequestRejected(
                    "prompt",
                    f"a pinned prefix needs at least one full block "
                    f"({self.engine.fleet.block_size} tokens), got {len(prompt_ids)}",
                )
            cores = self.engine.fleet.serving_cores()
            pins = [
                await pin_on_core(core, prompt_ids, request.cache_salt or None, self.engine.requests.next_seq_id())
                for core in cores
            ]
            pinned = [(core, p) for core, p in zip(cores, pins, strict=True) if p is not None]
            if not pinned:
                await abort(
                    context,
                    grpc.StatusCode.UNAVAILABLE,
                    "no worker could keep the prefix cached long enough to pin it (memory pressure)",
                )
            pin_id, tokens = pinned[0][1]
            self.pins.admit(
                self.pins.owner(bearer_token(context.invocation_metadata())),
                pin_id,
                {core.info.address: tokens // core.info.block_size for core, _ in pinned},
                {core.info.address: core.info.num_blocks for core, _ in pinned},
            )
        except DOMAIN_ERRORS as exc:
            await abort_with(context, exc)
        log.info("prefix pinned", pin_id=pin_id.hex(), tokens=tokens, workers=len(pinned))
        return serving_pb2.PinPrefixResponse(pin_id=pin_id.hex(), pinned_tokens=tokens, workers=len(pinned))

    async def UnpinPrefix(
        self, request: serving_pb2.UnpinPrefixRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.UnpinPrefixResponse:
        try:
            pin_id = bytes.fromhex(request.pin_id)
        except ValueError:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"pin_id: not a pin id: {request.pin_id!r}")
        owner = self.pins.owner(bearer_token(context.invocation_metadata()))
        return serving_pb2.UnpinPrefixResponse(unpinned=self.pins.release(owner, pin_id))

    async def Tokenize(
        self, request: serving_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.TokenizeResponse:
        try:
            if not request.prompt:
                raise RequestRejected("prompt", "must be non-empty text")
            check_prompt_chars(len(request.prompt), self.max_prompt_chars)
        except RequestRejected as exc:
            await abort_with(context, exc)
        special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await self.engine.tokenizer.encode_async(request.prompt, add_special_tokens=special)
        return serving_pb2.TokenizeResponse(
            token_ids=ids,
            max_model_len=self.engine.max_model_len,
            token_strs=self.engine.tokenizer.token_strs(ids) if request.return_token_strs else (),
        )

    async def Detokenize(
        self, request: serving_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.DetokenizeResponse:
        ids = list(request.token_ids)
        try:
            if len(ids) > self.engine.max_model_len:
                raise RequestRejected(
                    "token_ids", f"at most max_model_len ({self.engine.max_model_len}), got {len(ids)}"
                )
            check_in_vocab("token_ids", ids, self.engine.tokenizer.vocab_size)
        except RequestRejected as exc:
            await abort_with(context, exc)
        # Special tokens stay: the text is what the ids say, as vLLM's /detokenize answers.
        text = await self.engine.tokenizer.decode_async(ids, skip_special_tokens=False)
        return serving_pb2.DetokenizeResponse(text=text)

    async def ModelInfo(
        self, request: serving_pb2.ModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> serving_pb2.ModelInfoResponse:
        cores = self.engine.cores
        return serving_pb2.ModelInfoResponse(
            model=cores[0].info.model_name if cores else "",
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.tokenizer.vocab_size,
            runner="generate" if self.pooling is None else "pooling",
            lora_adapters=[
                serving_pb2.LoraAdapterInfo(name=a.name, path=a.path, rank=a.rank)
                for a in sorted(lora.adapters.values(), key=lambda a: a.name)
            ]
            if (lora := self.engine.fleet.lora) is not None
            else [],
            classifier_from_token=self._classifier_tokens(),
            weight_format=cores[0].info.weight_format if cores else "",
        )

    def _classifier_tokens(self) -> list[str]:
        ids = self.pooling.classifier_token_ids if self.pooling is not None else None
        return [self.engine.tokenizer.token_text(i) for i in ids or ()]
