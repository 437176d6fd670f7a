"""Load a benchmark puts on the services: prompts (random token ids, or English-ish
text), N concurrent Generate streams from one asyncio client (`drive`), streams read
on threads with every token's arrival time (`TimedStream`), requests sent all at
once or paced (`send_all`), and waiting for a condition."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from proto import serving_pb2, serving_pb2_grpc
from svc_common.grpc_options import channel_options


# ---- prompts ------------------------------------------------------------------------------
def random_token_ids(n: int, rng: random.Random, low: int = 100, high: int = 40000) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def random_prompts(n: int, seed: int, low: int, high: int, lengths: tuple[int, int]) -> list[list[int]]:
    """n prompts of random ids in [low, high), each of a length in `lengths` (inclusive), seeded."""
    rng = random.Random(seed)
    return [random_token_ids(rng.randint(*lengths), rng, low, high) for _ in range(n)]


def text_words() -> list[str]:
    """English-ish technical prose that ships with CPython (the Language Reference)."""
    from pydoc_data.topics import topics

    return " ".join(topics[k] for k in sorted(topics)).split()


def word_prompts(n: int, min_words: int = 20, max_words: int = 120, seed: int = 0) -> list[str]:
    """n prompts of min_words..max_words words (uniform), cut from the text at random places."""
    words = text_words()
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(min_words, max_words)
        start = rng.randrange(0, len(words) - length)
        prompts.append(" ".join(words[start : start + length]))
    return prompts


# ---- N concurrent streams from one asyncio client -------------------------------------------
@dataclass
class StreamsRun:
    tokens: int  # completion tokens received
    wall_s: float  # from the first Generate call to the last stream's end
    gaps_ms: list[float]  # between consecutive token-carrying messages of one stream, pooled

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


async def drive(
    address: str, prompts: Sequence[list[int]], max_tokens: int, fields: dict[str, Any] | None = None
) -> StreamsRun:
    """One grpc.aio channel, one Generate stream per prompt, all at once: greedy,
    ignore_eos, max_tokens each; `fields`: more GenerateRequest fields, instead of
    ignore_eos (a structured-output constraint that cannot end before max_tokens).
    Raises if a stream fails or comes up short."""
    channel = grpc.aio.insecure_channel(address, options=channel_options())
    stub = serving_pb2_grpc.SchedulerStub(channel)
    gaps: list[float] = []
    tokens = 0
    errors: list[str] = []

    async def one(ids: list[int]) -> None:
        nonlocal tokens
        last = None
        request = serving_pb2.GenerateRequest(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, **(fields or {"ignore_eos": True})
        )
        try:
            async for reply in stub.Generate(request, timeout=1800):
                if reply.token_ids:
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now
                    tokens += len(reply.token_ids)
        except grpc.aio.AioRpcError as err:
            errors.append(f"{err.code().name}: {err.details()}")

    try:
        await channel.channel_ready()
        started = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in prompts))
        wall = time.perf_counter() - started
    finally:
        await channel.close()
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} streams failed, e.g. {errors[0]}")
    if tokens != len(prompts) * max_tokens:
        raise RuntimeError(f"expected {len(prompts) * max_tokens} tokens, got {tokens}")
    return StreamsRun(tokens, wall, gaps)


# ---- streams read on threads, every token timed ---------------------------------------------
@dataclass
class TimedStream:
    """One Generate stream read on its own thread: arrival time of every token."""

    client: Any  # SchedulerClient
    token_ids: list[int]
    max_tokens: int
    times: list[float] = field(default_factory=list)  # perf_counter per received token
    received: list[int] = field(default_factory=list)  # the token ids, in order
    first_token_at: float | None = None
    finished_at: float | None = None
    started_at: float = 0.0
    error: str | None = None
    _call: Any = None
    _thread: threading.Thread | None = None
    _cancelled: bool = False

    def start(self) -> TimedStream:
        self.started_at = time.perf_counter()
        self._call = self.client.stream(
            prompt_token_ids=self.token_ids, max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True, timeout=3600
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        try:
            for reply in self._call:
                now = time.perf_counter()
                self.received.extend(reply.token_ids)
                for _ in reply.token_ids:
                    self.times.append(now)
                if reply.token_ids and self.first_token_at is None:
                    self.first_token_at = now
                if reply.finished:
                    break
        except grpc.RpcError as err:
            if not self._cancelled:
                self.error = f"{err.code().name}: {err.details()}"
        self.finished_at = time.perf_counter()

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def join(self, timeout: float | None = None) -> None:
        if self._thread:
            self._thread.join(timeout)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def gaps_ms(self, start: float, end: float) -> list[float]:
        """Inter-token gaps whose later token arrived in (start, end]."""
        return [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:]) if start < b <= end]


def join_streams(streams: Sequence[TimedStream], timeout_s: float = 30.0) -> None:
    """Wait for every stream's reader to end (cancel the endless ones first); raise if one failed."""
    for s in streams:
        s.join(timeout_s)
        if s.error:
            raise RuntimeError(f"stream failed: {s.error}")


def wait_until(
    predicate: Callable[[], bool],
    timeout_s: float,
    interval_s: float = 0.01,
    what: str = "condition",
    streams: Sequence[TimedStream] = (),
) -> None:
    """Poll predicate(); raise if it is still false after timeout_s, or at once if
    one of `streams` failed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if failed := next((s for s in streams if s.error), None):
            raise RuntimeError(f"a stream failed while waiting for {what}: {failed.error}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def send_all(cases: Sequence[Any], send: Callable[[Any], Any], arrival: str, gap_ms: float) -> tuple[list[Any], float]:
    """send(case) for every case, one thread each: all at once ("burst") or one every
    gap_ms ("paced"). The replies in case order, and the wall time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = []
        for case in cases:
            futures.append(pool.submit(send, case))
            if arrival == "paced":
                time.sleep(gap_ms / 1e3)
        replies = [f.result() for f in futures]
    return replies, time.perf_counter() - start
