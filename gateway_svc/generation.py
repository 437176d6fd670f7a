"""The Generate calls of one HTTP request, merged into one stream of (choice index, message).

An OpenAI request with n choices (or a batch of prompts) is several serving.v1
Generate streams; one reader task per call feeds a queue so the HTTP side sees
them as a single ordered stream. At most `window` calls run at once (the
gateway's --max-parallel-per-request): the next starts when one ends, so a batch
of a thousand prompts takes a share of the scheduler's queue and batch, and
other requests interleave with it. `cancel()` cancels every call that is still
running and starts no more (a disconnect, an error in a sibling, or the end of
the response), and wakes whoever is waiting on the stream.

The queue is bounded by the bytes of its unread messages (the gateway's
--max-stream-buffer-bytes): a client that reads its stream slower than the
scheduler writes it would otherwise make the gateway hold its whole answer. Past
the bound the generation ends with SlowReader: its calls are cancelled (the
scheduler frees their blocks), the unread output is dropped, and the client's
stream ends with an error event saying why.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from gateway_svc.chat_output import ChatOutput
from gateway_svc.convert import Sample
from gateway_svc.errors import error_body, grpc_error, shutting_down, slow_reader
from gateway_svc.results import Results
from gateway_svc.scheduler_client import GenerateCall, Scheduler
from proto import serving_pb2

log = structlog.get_logger("gateway")
_DONE = None  # queue item: a call ended normally
# What a reader puts on the queue: a message, _DONE, or the error that ended its call.
_Item = serving_pb2.GenerateResponse | BaseException | None


class ClientGone(Exception):
    """The generation was cancelled (the HTTP client went away) while being read."""


class ShuttingDown(Exception):
    """The gateway is stopping and the drain timeout has passed: the generation ends now."""


class SlowReader(Exception):
    """The client read its stream too slowly: the unread output passed the bound."""


class Generation:
    def __init__(
        self, client: Scheduler, samples: list[Sample], api_key: str | None, window: int = 0, max_unread: int = 0
    ):
        """window: calls at once (0: all of them); max_unread: bytes of unread messages at most (0: no bound)."""
        self._client, self._api_key = client, api_key
        self._max_unread, self._unread = max_unread, 0
        self._unstarted = deque(samples)
        self._calls: dict[int, GenerateCall] = {}
        self._queue: asyncio.Queue[tuple[int, _Item]] = asyncio.Queue()
        self._readers: list[asyncio.Task[None]] = []
        self._running = len(samples)  # calls not ended yet, started or not
        self._head: list[tuple[int, serving_pb2.GenerateResponse | None]] = []
        self._cancelled = False
        for _ in range(min(window or len(samples), len(samples))):
            self._start_next()

    def _start_next(self) -> None:
        if self._cancelled or not self._unstarted:
            return
        sample = self._unstarted.popleft()
        call = self._client.generate(sample.request, self._api_key)
        self._calls[sample.index] = call
        self._readers.append(asyncio.create_task(self._read(sample.index, call)))

    async def _read(self, index: int, call: GenerateCall) -> None:
        try:
            async for message in call:
                self._unread += message.ByteSize()
                if self._max_unread and self._unread > self._max_unread:
                    self._cut_slow_reader()
                    return
                self._queue.put_nowait((index, message))
            self._queue.put_nowait((index, _DONE))
        except Exception as exc:  # AioRpcError mostly; anything else must not leave the reader hanging
            self._queue.put_nowait((index, exc))
            return
        self._start_next()  # its place in the window goes to the next prompt

    def _cut_slow_reader(self) -> None:
        while not self._queue.empty():  # what the client never read goes now, not when it reads
            self._queue.get_nowait()
        self.cancel(
            SlowReader(
                f"the client read this stream too slowly: more than {self._max_unread} bytes of output were waiting "
                "for it (--max-stream-buffer-bytes); the generation was stopped"
            )
        )

    async def _next(self) -> tuple[int, serving_pb2.GenerateResponse | None]:
        index, item = await self._queue.get()
        if isinstance(item, serving_pb2.GenerateResponse):
            self._unread -= item.ByteSize()
        if isinstance(item, BaseException):
            # One failed choice fails the request: stop its siblings so they free their blocks.
            self.cancel()
            raise item
        return index, item

    async def start(self) -> None:
        """Wait for the first message (or the end) of every call started so far.

        Admission errors (bad argument, queue full, no worker) arrive before any
        output; waiting for them lets a streaming request still answer with an
        HTTP error status instead of a 200 whose stream breaks.
        """
        waiting = set(self._calls)
        while waiting:
            item = await self._next()
            self._head.append(item)
            waiting.discard(item[0])

    async def events(self) -> AsyncIterator[tuple[int, serving_pb2.GenerateResponse]]:
        while self._head or self._running:
            index, message = self._head.pop(0) if self._head else await self._next()
            if message is _DONE:
                self._running -= 1
                continue
            yield index, message

    def cancel(self, why: Exception | None = None) -> None:
        """Cancel every call still running; idempotent, and a no-op on finished calls.
        Whoever reads the generation then gets `why` (default: ClientGone)."""
        if self._cancelled:
            return
        self._cancelled = True
        self._unstarted.clear()
        for call in self._calls.values():
            call.cancel()
        for reader in self._readers:
            reader.cancel()
        # Wake a consumer blocked in _next(): the readers will never put anything now.
        self._queue.put_nowait((-1, why or ClientGone("generation cancelled")))


async def guarded(events: AsyncIterator[str], error_event: Callable[[dict[str, Any]], str]) -> AsyncIterator[str]:
    """An event stream that ends cleanly however its generation fails: the 200 is already
    sent, so an error travels as an event (`error_event` of OpenAI's error body), and a
    client that went away ends it quietly."""
    try:
        async for event in events:
            yield event
    except grpc.aio.AioRpcError as err:
        yield error_event(grpc_error(err.code(), err.details()).body())
    except ClientGone:
        return
    except ShuttingDown as exc:  # the drain timeout passed: end cleanly, the client knows why
        yield error_event(shutting_down(str(exc)).body())
    except SlowReader as exc:  # its calls are cancelled already; this event is all it still gets
        log.info("slow reader cut", error=str(exc))
        yield error_event(slow_reader(str(exc)).body())
    except Exception as exc:  # a bug of ours: tell the client, keep the trace in our log
        log.exception("stream failed", error=repr(exc))
        yield error_event(error_body("internal error", "internal_error"))


@dataclass(frozen=True)
class AnswerStep:
    """A piece of one streamed chat answer: the chat delta it adds (reasoning_content, content,
    tool_calls pieces); on the last, the finish reason and whether the answer called tools."""

    delta: dict[str, Any]
    results: Results
    finished: bool = False
    reason: str | None = None
    called: bool = False


async def answer_steps(generation: Generation, samples: list[Sample], reading: ChatOutput) -> AsyncIterator[AnswerStep]:
    """The one choice of a chat generation as chat deltas, read by `reading` (what other APIs
    stream over chat write their events from these)."""
    results = Results(samples)
    stream = reading.stream()
    async for index, message in generation.events():
        delta = results.add(index, message)
        yield AnswerStep(stream.feed(delta.text), results)
        if message.finished:
            reason = results.choices[index].finish_reason
            said = stream.finish(reason)
            yield AnswerStep(said, results, True, reason, stream.called)


async def prompt_token_counts(client: Scheduler, samples: list[Sample], api_key: str | None) -> dict[int, int]:
    """Each prompt group's token count, as Generate counts it (the tokenizer's special tokens
    added): what continuous usage stats report before the scheduler's usage arrives at the end."""
    counts: dict[int, int] = {}
    for sample in samples:
        if sample.group in counts:
            continue
        request = sample.request
        if request.prompt_token_ids:
            counts[sample.group] = len(request.prompt_token_ids)
        else:
            reply = await client.tokenize(request.prompt, True, False, api_key)
            counts[sample.group] = len(reply.token_ids)
    return counts


class LiveGenerations:
    """The generations in flight, so that a stopping gateway can wait for them and,
    past its drain timeout, end them with an error instead of cutting them."""

    def __init__(self) -> None:
        self._live: set[Generation] = set()

    def __len__(self) -> int:
        return len(self._live)

    def add(self, generation: Generation) -> None:
        self._live.add(generation)

    def discard(self, generation: Generation) -> None:
        self._live.discard(generation)

    def shut_down(self, why: str) -> int:
        """End every live generation: its reader gets ShuttingDown(why). Returns how many."""
        ended = list(self._live)
        for generation in ended:
            generation.cancel(ShuttingDown(why))
        self._live.clear()
        return len(ended)
