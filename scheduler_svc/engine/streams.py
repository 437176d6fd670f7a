"""Per-request stream state: turns planner updates into client events
(text deltas, progress, finish, usage) and detects stop strings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from scheduler_svc.engine.timing import EngineHooks, RequestTiming
from scheduler_svc.planning.plan import RequestUpdate
from scheduler_svc.request import FinishReason, Request, TokenLogprob
from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.tokenizer import ModelTokenizer


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class StreamEvent:
    """One message to a client: what one or more steps (coalesce) added to one sample's stream."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)  # with sampling.logprobs
    prompt_logprobs: list[TokenLogprob] | None = None  # every prompt token, once
    progress: tuple[int, int] | None = None
    finished: bool = False
    finish_reason: str = ""
    usage: Usage | None = None
    # Set when the stream ends with an error instead (a domain error: api/status.py gives its code).
    error: Exception | None = None
    index: int = 0  # which of a request's n samples
    embedding: list[float] | None = None  # a pooling request's, on its finished event
    # What ended a sample with finish_reason stop, when it was a stop string or a stop_token_ids id.
    stop_string: str | None = None
    stop_token_id: int | None = None

    def absorb(self, later: StreamEvent) -> None:
        """Append a later event of the same sample, so one message carries both
        (each event owns its lists)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        self.top_logprobs += later.top_logprobs
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.progress = later.progress or self.progress
        if later.finished:
            self.finished, self.finish_reason, self.usage = True, later.finish_reason, later.usage
            self.stop_string, self.stop_token_id = later.stop_string, later.stop_token_id


def coalesce(events: asyncio.Queue[StreamEvent], first: StreamEvent) -> tuple[StreamEvent, StreamEvent | None]:
    """`first` with the token events already queued behind it, as one event: a
    client slower than the steps gets every token it missed in one message
    rather than one message per token. Returns (merged, an error event taken off
    the queue that must follow it, or None). Only for one-sample requests, whose
    events all belong to the same stream."""
    error = None
    while not (first.finished or first.error or events.empty()):
        later = events.get_nowait()
        if later.error:
            error = later
            break
        first.absorb(later)
    return first, error


@dataclass
class StreamHandle:
    """What the client call reads: one queue for all of a request's samples."""

    events: asyncio.Queue[StreamEvent]
    num_samples: int  # finished events that end the call
    member_ids: list[str]  # planner request ids behind it (a fork parent and its children)


class RequestStream:
    def __init__(
        self,
        request: Request,
        tokenizer: ModelTokenizer,
        events: asyncio.Queue[StreamEvent] | None = None,
        hooks: EngineHooks[Any] = EngineHooks(),
    ):
        self.request = request
        self.detokenizer = IncrementalDetokenizer.for_prompt(tokenizer, request.prompt_token_ids, request.sampling.stop)
        self.events: asyncio.Queue[StreamEvent] = events if events is not None else asyncio.Queue()
        self.closed = False
        self.reported_progress = False  # a multi-chunk prompt: progress events were sent
        # Sees every token event of the request: TTFT, inter-token and end-to-end histograms.
        self.timing = RequestTiming(request.arrival_time, hooks.latency, hooks.clock)

    def on_update(self, update: RequestUpdate) -> bool:
        """Queue the event for one planner update. Returns True when a stop string
        ended the request (the caller must then finish it in the planner)."""
        if update.forked:
            self.closed = True  # a fork parent: its children's streams take over
            return False
        token_id = update.token_id
        if token_id is not None and not self.closed:
            self.timing.on_tokens(1)
        if update.prefill_progress is not None and token_id is None and not update.finished:
            self._put(StreamEvent(progress=update.prefill_progress))
            self.reported_progress = True
            return False
        # A prompt that took several chunks gets its final (total, total) with the first token.
        progress = update.prefill_progress if self.reported_progress else None
        text = self.detokenizer.add(token_id) if token_id is not None else ""
        hit_stop = self.detokenizer.stopped and not update.finished
        if hit_stop and update.num_output_tokens:
            # Inside an accepted run of drafts: the run's later tokens were never generated.
            self.request.truncate_output(update.num_output_tokens)
        if update.finished or hit_stop:
            self._finish(text + self.detokenizer.flush(), update, self._reason(update), progress)
        elif token_id is not None:
            self._put(self._tokens_event(text, update, progress))
        return hit_stop

    def _reason(self, update: RequestUpdate) -> FinishReason | None:
        """The finish reason of an update that ends the stream: a stop string found in the
        text ends it with stop, even on the token that also reached the length."""
        if self.detokenizer.stopped and update.finish_reason in (None, FinishReason.LENGTH):
            return FinishReason.STOP
        return update.finish_reason

    def _tokens_event(self, text: str, update: RequestUpdate, progress: tuple[int, int] | None) -> StreamEvent:
        """The event carrying an update's token (if any), its text and logprobs."""
        if update.token_id is None:
            return StreamEvent(text=text, prompt_logprobs=self._prompt_logprobs(update), progress=progress)
        return StreamEvent(
            text=text,
            token_ids=[update.token_id],
            logprobs=[update.logprob],
            top_logprobs=[] if update.top_logprobs is None else [update.top_logprobs],
            prompt_logprobs=self._prompt_logprobs(update),
            progress=progress,
        )

    def _prompt_logprobs(self, update: RequestUpdate) -> list[TokenLogprob] | None:
        """The update's prompt logprobs, from the first prompt token (which has none)."""
        if update.prompt_logprobs is None:
            return None
        return [TokenLogprob(self.request.prompt_token_ids[0], None), *update.prompt_logprobs]

    def abort(self) -> None:
        self._finish("", RequestUpdate(self.request.request_id), FinishReason.ABORT)

    def fail(self, error: Exception) -> None:
        if not self.closed and not self.request.prefill_only:
            self.timing.finish("error")
        self._put(StreamEvent(error=error))
        self.closed = True

    def _finish(
        self, text: str, update: RequestUpdate, reason: FinishReason | None, progress: tuple[int, int] | None = None
    ) -> None:
        r = self.request
        if not self.closed and not r.prefill_only:
            self.timing.finish(str(reason or FinishReason.STOP))
        event = self._tokens_event(text, update, progress)
        event.finished, event.finish_reason = True, str(reason or FinishReason.STOP)
        event.embedding = update.embedding
        if reason in (None, FinishReason.STOP):
            event.stop_string = self.detokenizer.matched
            if event.stop_string is None and update.token_id in r.sampling.stop_token_ids:
                event.stop_token_id = update.token_id
        event.usage = Usage(r.num_prompt_tokens, r.num_output_tokens, r.num_cached_prompt_tokens)
        self._put(event)
        self.closed = True

    def _put(self, event: StreamEvent) -> None:
        if not self.closed:
            event.index = self.request.sample_index
            self.events.put_nowait(event)


def open_streams(
    request: Request, tokenizer: ModelTokenizer, hooks: EngineHooks[Any] = EngineHooks()
) -> tuple[StreamHandle, dict[str, RequestStream]]:
    """The client handle and the per-request streams feeding it: a fork parent
    reports prefill progress, each of its children one sample."""
    events: asyncio.Queue[StreamEvent] = asyncio.Queue()
    members = [request, *request.children]
    streams = {m.request_id: RequestStream(m, tokenizer, events, hooks) for m in members}
    return StreamHandle(events, len(request.children) or 1, list(streams)), streams
