"""The steps of one run of overlapped steps (EngineCore._run_steps) on one StepStream
call to the worker: sent in order and answered in that order (the worker runs them in
order), at about half a unary call's transport per step (bench/results/itl_split.md).
A step the worker refuses fails alone, with the code a unary call would end with; a
stream that breaks fails every step still unanswered."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

import grpc

from proto import worker_pb2
from scheduler_svc.engine.worker_client import (
    StepResult,
    WorkerClient,
    call_failed,
    plan_to_proto,
    result_from_proto,
    stream_ended,
)
from scheduler_svc.planning.plan import StepPlan

# The readers of streams still ending (asyncio keeps only weak references to tasks).
_READERS: set[asyncio.Task[None]] = set()


class StepStream:
    def __init__(self, client: WorkerClient):
        self._client = client
        self._call = client.open_step_stream()
        self._replies: deque[asyncio.Future[worker_pb2.StepReply]] = deque()
        self._sending = asyncio.Lock()
        self._ended = stream_ended(client.address, "the step stream ended before the reply")
        self._reader = asyncio.create_task(self._read())
        _READERS.add(self._reader)
        self._reader.add_done_callback(_READERS.discard)

    async def step(self, plan: StepPlan) -> StepResult:
        """The step's result. Raises WorkerCallFailed, as a unary Step call would."""
        request = plan_to_proto(plan)
        async with self._sending:  # one write at a time, in the order of the replies
            if self._reader.done():
                raise self._ended
            reply: asyncio.Future[worker_pb2.StepReply] = asyncio.get_running_loop().create_future()
            self._replies.append(reply)
            try:
                await self._call.write(request)
            except asyncio.CancelledError:  # whether it went out is not known: no reply could be matched
                self._call.cancel()
                raise
            except (grpc.aio.AioRpcError, grpc.aio.UsageError):
                self._call.cancel()  # the reader fails every step unanswered
        return self._result(await reply)

    async def close(self) -> None:
        """Ends the stream: cancelled where steps are unanswered (abandoned: their results
        no longer count, as a unary call's cancel), else done writing: the worker ends it,
        and the next run's stream need not wait for that."""
        if self._replies:
            self._call.cancel()
            return
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
            await self._call.done_writing()

    async def _read(self) -> None:
        try:
            async for reply in self._call:
                if not self._replies:
                    self._ended = stream_ended(self._client.address, "the worker replied to no step")
                    self._call.cancel()
                    return
                waiter = self._replies.popleft()
                if not waiter.done():  # a cancelled (abandoned) step's reply is dropped
                    waiter.set_result(reply)
        except grpc.aio.AioRpcError as err:
            self._ended = self._client.failure(err)
        finally:
            while self._replies:
                waiter = self._replies.popleft()
                if not waiter.done():
                    waiter.set_exception(self._ended)

    def _result(self, reply: worker_pb2.StepReply) -> StepResult:
        if reply.HasField("refusal"):
            raise call_failed(self._client.address, reply.refusal.code, reply.refusal.details)
        return result_from_proto(reply.response)
