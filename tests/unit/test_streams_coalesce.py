"""A slow client's queued token events go out as one message, in order, and an
error or the finish is never merged past."""

from __future__ import annotations

import asyncio

from scheduler_svc.engine.errors import WorkerUnavailable
from scheduler_svc.engine.streams import StreamEvent, Usage, coalesce


def queue_of(*events: StreamEvent) -> asyncio.Queue[StreamEvent]:
    queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    return queue


def test_queued_tokens_merge_into_one_event_up_to_the_finish():
    usage = Usage(5, 4, 0)
    queue = queue_of(
        StreamEvent("b", [2], [-0.2]),
        StreamEvent("", [], [], progress=(5, 5)),
        StreamEvent("c", [3], [-0.3]),
        StreamEvent("d", [4], [-0.4], finished=True, finish_reason="length", usage=usage),
        StreamEvent("never", [9]),
    )
    merged, error = coalesce(queue, StreamEvent("a", [1], [-0.1]))
    assert (merged.text, merged.token_ids, merged.logprobs) == ("abcd", [1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4])
    assert merged.finished and merged.finish_reason == "length" and merged.usage == usage
    assert merged.progress == (5, 5) and error is None
    assert queue.qsize() == 1  # nothing past the finish is taken


def test_an_error_stops_the_merge_and_is_handed_back():
    queue = queue_of(
        StreamEvent("b", [2], [-0.2]),
        StreamEvent(error=WorkerUnavailable("gone")),
        StreamEvent("c", [3]),
    )
    merged, error = coalesce(queue, StreamEvent("a", [1], [-0.1]))
    assert merged.token_ids == [1, 2] and not merged.finished
    assert error is not None and isinstance(error.error, WorkerUnavailable) and queue.qsize() == 1


def test_nothing_waiting_leaves_the_event_alone():
    first = StreamEvent("a", [1], [-0.1])
    merged, error = coalesce(queue_of(), first)
    assert merged is first and merged.token_ids == [1] and error is None
