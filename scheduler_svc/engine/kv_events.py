"""Each worker's KV-event stream: the changes of its prefix index
(kv/events.py), one batch per engine step, numbered per worker from 0 and kept
in a bounded buffer, so that a subscriber that reconnects with the last
sequence number it saw gets exactly what it missed, or a gap marker when some
of it is gone (admin.v1 SubscribeKvEvents). Sinks (the ZMQ publisher,
api/kv_events_zmq.py) get every batch as it is published.

A worker's stream lives as long as the scheduler, keyed by its address: a
worker drained and added again continues its numbering (its index was
cleared, AllBlocksCleared, when it left).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog

from scheduler_svc.kv.events import AllBlocksCleared, KVCacheEvent

log = structlog.get_logger(__name__)

DEFAULT_BUFFER_STEPS = 1024


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One step's index changes on one worker; or, with `missed`, a gap marker
    (no events) saying that batches missed[0]..missed[1] are no longer
    buffered: the subscriber's view of that worker is stale. `seq` is then
    missed[1], so it is always the position to resume from."""

    worker: str
    rank: int  # the worker's data-parallel rank: 0, 1, ... in the order the scheduler first saw each address
    seq: int
    ts: float  # time.time() when published
    events: tuple[KVCacheEvent, ...] = ()
    missed: tuple[int, int] | None = None


class KvEventSink(Protocol):
    def add_worker(self, worker: str, rank: int) -> None:
        """A worker's stream starts (before its first batch)."""

    def publish(self, batch: KvEventBatch) -> None:
        """A new batch; must not block the event loop."""


class WorkerKvEvents:
    """One worker's numbered batches and their replay buffer."""

    def __init__(
        self, worker: str, rank: int = 0, capacity: int = DEFAULT_BUFFER_STEPS, hub: KvEventHub | None = None
    ) -> None:
        self.worker, self.rank = worker, rank
        self.next_seq = 0
        self.buffer: deque[KvEventBatch] = deque(maxlen=capacity)
        self._hub = hub

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Number and publish one batch (nothing when `events` is empty)."""
        if not events:
            return
        batch = KvEventBatch(self.worker, self.rank, self.next_seq, time.time(), tuple(events))
        self.next_seq += 1
        self.buffer.append(batch)
        if self._hub is not None:
            self._hub.published(batch)

    def since(self, last_seq: int) -> list[KvEventBatch]:
        """The batches after `last_seq` (-1: from the first), preceded by a gap
        marker when some of them have left the buffer. A `last_seq` this stream
        never reached (a subscriber of an earlier scheduler run) is stale as a
        whole: a gap marker, then everything buffered."""
        last_seq = max(last_seq, -1)
        oldest = self.buffer[0].seq if self.buffer else self.next_seq
        replies: list[KvEventBatch] = []
        if last_seq >= self.next_seq or last_seq + 1 < oldest:
            first = 0 if last_seq >= self.next_seq else last_seq + 1
            replies.append(KvEventBatch(self.worker, self.rank, oldest - 1, time.time(), missed=(first, oldest - 1)))
            last_seq = oldest - 1
        count = self.next_seq - 1 - last_seq
        replies.extend(self.buffer[i] for i in range(len(self.buffer) - count, len(self.buffer)))
        return replies


class KvEventHub:
    """Every worker's stream, its subscribers and sinks."""

    def __init__(self, buffer_steps: int = DEFAULT_BUFFER_STEPS) -> None:
        self.buffer_steps = buffer_steps
        self.workers: dict[str, WorkerKvEvents] = {}
        self.sinks: list[KvEventSink] = []
        self._changed = asyncio.Event()

    def worker(self, address: str) -> WorkerKvEvents:
        """The worker's stream, started on first use with the next rank."""
        stream = self.workers.get(address)
        if stream is None:
            stream = self.workers[address] = WorkerKvEvents(address, len(self.workers), self.buffer_steps, self)
            for sink in self.sinks:
                try:
                    sink.add_worker(address, stream.rank)
                except Exception:  # a sink must not stop a worker from joining
                    log.exception("kv event sink failed to add a worker", worker=address, rank=stream.rank)
        return stream

    def add_sink(self, sink: KvEventSink) -> None:
        """Start `sink` on every stream so far (errors propagate: a start-up
        failure), then give it every new batch."""
        for stream in self.workers.values():
            sink.add_worker(stream.worker, stream.rank)
        self.sinks.append(sink)

    def worker_removed(self, address: str) -> None:
        """The worker left: whatever its index held is gone from this scheduler."""
        self.worker(address).publish([AllBlocksCleared()])

    def published(self, batch: KvEventBatch) -> None:
        for sink in self.sinks:
            try:
                sink.publish(batch)
            except Exception:  # subscribers of the hub still get it
                log.exception("kv event sink failed", worker=batch.worker, seq=batch.seq)
        self._changed.set()
        self._changed = asyncio.Event()

    async def subscribe(self, last_seq: Mapping[str, int]) -> AsyncIterator[KvEventBatch]:
        """Every worker's batches after `last_seq[worker]` (a worker not listed:
        from its first batch), then new ones as they come, until cancelled."""
        cursors = dict(last_seq)
        while True:
            changed = self._changed  # taken before looking: a batch published after it wakes us
            sent = False
            for address, stream in list(self.workers.items()):
                for batch in stream.since(cursors.get(address, -1)):
                    cursors[address] = batch.seq
                    sent = True
                    yield batch
            if not sent:
                await changed.wait()
