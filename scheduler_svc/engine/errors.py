"""What the engine raises. Plain domain errors: api/status.py maps each to a
gRPC status code, so nothing below the API layer knows the transport."""

from __future__ import annotations


class StartupError(RuntimeError):
    """A worker could not be reached or does not match the others."""


class WorkerUnavailable(RuntimeError):
    """No healthy worker can take the request."""


class SchedulerBug(RuntimeError):
    """A request ended by the scheduler's own fault (a step the worker refused, a
    failed step loop); the details are in the scheduler's log."""


class WorkerAdminError(Exception):
    """A worker cannot be added or drained as asked."""


class UnknownWorker(WorkerAdminError):
    """No worker with that address."""


class WorkerExists(WorkerAdminError):
    """add_worker: the address is already a worker (serving, draining or unhealthy)."""


class WorkerUnreachable(WorkerAdminError):
    """add_worker: the worker did not answer Info within the connect timeout."""


class WorkerUntrusted(WorkerAdminError):
    """add_worker: an address the scheduler may not send its internal token (engine/worker_trust.py)."""


class WorkerIncompatible(WorkerAdminError):
    """add_worker: another model, vocabulary or block size than the current workers."""


class LastWorker(WorkerAdminError):
    """drain_worker: it is the last serving worker and allow_last is false."""


class WorkerCallFailed(Exception):
    """An Info or Step call to a worker failed. `transient`: the worker may come
    back (it died, restarted, the network dropped, the call timed out), so the
    work is requeued; otherwise the worker refused the call and would refuse it
    again."""

    def __init__(self, address: str, transient: bool, reason: str, details: str) -> None:
        super().__init__(f"{reason}: {details}")
        self.address = address
        self.transient = transient
        self.reason = reason
        self.details = details
