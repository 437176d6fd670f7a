"""The one mapping of domain errors to gRPC status codes. Below the API layer
errors are plain exceptions; here each gets the code a client sees."""

from __future__ import annotations

from typing import NoReturn

import grpc

from scheduler_svc.engine.errors import (
    LastWorker,
    SchedulerBug,
    UnknownWorker,
    WorkerExists,
    WorkerIncompatible,
    WorkerUnavailable,
    WorkerUnreachable,
    WorkerUntrusted,
)
from scheduler_svc.kv.block_manager import PinLimitExceeded
from scheduler_svc.lora.errors import LoraAdapterExists, LoraAdapterNotFound, LoraDisabled, LoraRejected
from scheduler_svc.planning.queues import QueueFull
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.structured.errors import ConstraintRejected, GrammarFailed, TokenRejected

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (RequestRejected, grpc.StatusCode.INVALID_ARGUMENT),
    (ConstraintRejected, grpc.StatusCode.INVALID_ARGUMENT),  # a structured output that cannot compile
    # A constrained output that cannot go on: its grammar refused the sampled token (a text this
    # vocabulary cannot spell) or hit one of the grammar engine's limits. A stream ends with these.
    (TokenRejected, grpc.StatusCode.INVALID_ARGUMENT),
    (GrammarFailed, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (PinLimitExceeded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (WorkerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (UnknownWorker, grpc.StatusCode.NOT_FOUND),
    (WorkerExists, grpc.StatusCode.ALREADY_EXISTS),
    (WorkerUnreachable, grpc.StatusCode.UNAVAILABLE),
    (WorkerIncompatible, grpc.StatusCode.FAILED_PRECONDITION),
    (WorkerUntrusted, grpc.StatusCode.PERMISSION_DENIED),  # no internal token for an address not configured
    (LastWorker, grpc.StatusCode.FAILED_PRECONDITION),
    (LoraRejected, grpc.StatusCode.INVALID_ARGUMENT),  # an adapter we cannot serve, named by field
    (LoraAdapterExists, grpc.StatusCode.ALREADY_EXISTS),
    (LoraAdapterNotFound, grpc.StatusCode.NOT_FOUND),
    (LoraDisabled, grpc.StatusCode.FAILED_PRECONDITION),
    (SchedulerBug, grpc.StatusCode.INTERNAL),  # a stream ended by the scheduler's own fault
)
# What a servicer catches and turns into a status; anything else is a bug (INTERNAL).
DOMAIN_ERRORS: tuple[type[Exception], ...] = tuple(cls for cls, _ in _CODES)


def status_code(exc: Exception) -> grpc.StatusCode:
    return next(code for cls, code in _CODES if isinstance(exc, cls))


async def abort_with(context: grpc.aio.ServicerContext, exc: Exception) -> NoReturn:
    """End the call with the code of `exc` and its message."""
    await abort(context, status_code(exc), str(exc) or type(exc).__name__)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """context.abort, typed: it always raises."""
    await context.abort(code, message)
    raise AssertionError("context.abort returned")
