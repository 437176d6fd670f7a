"""The Step calls of worker.v1: one step per unary call (Step), or the steps of one run
of overlapped steps on a stream (StepStream: about half the transport per step,
bench/results/itl_split.md). Both run a step the same way; a step that is not run is
refused with the same status code, ending the unary call, or in its reply on a stream,
which goes on."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
import structlog

from proto import worker_pb2
from worker_svc.step.errors import InvalidStep, StaleStep, StepOutOfMemory, WorkerDown
from worker_svc.step_proto import masks_from_proto, step_from_proto, step_to_proto
from worker_svc.worker import Worker

log = structlog.get_logger(__name__)


class StepRefused(Exception):
    """A step not run: the status code its call ends with, and why."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code = code
        self.details = details


# A step as it arrived on a stream, and its refusal where its riding masks were malformed.
_Arrival = tuple[worker_pb2.StepRequest, StepRefused | None]


def run_step(worker: Worker, request: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
    """The step's response, or StepRefused naming why it was not run."""
    step_log = log.bind(step_id=request.step_id)
    try:
        out = worker.step(step_from_proto(request))
    except InvalidStep as exc:
        step_log.warning("step rejected", error=str(exc))
        raise StepRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
    except StaleStep as exc:
        step_log.warning("step refused", error=str(exc))
        raise StepRefused(grpc.StatusCode.ABORTED, str(exc)) from None
    except StepOutOfMemory as exc:
        step_log.warning("step ran out of device memory: refused, the worker serves on", error=str(exc), fatal=False)
        raise StepRefused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"step out of device memory: {exc}") from None
    except WorkerDown as exc:  # a rank gone, a CUDA error: the scheduler treats it as a dead worker
        step_log.error("step failed: worker going down", error=str(exc), fatal=True)
        raise StepRefused(grpc.StatusCode.UNAVAILABLE, f"worker going down: {exc}") from None
    except Exception as exc:  # a bug must not take the worker down
        step_log.exception("step failed: the worker serves on", fatal=False)
        raise StepRefused(grpc.StatusCode.INTERNAL, f"step failed: {type(exc).__name__}: {exc}") from None
    step_log.debug("step done", seqs=len(request.seqs.seq_ids), tokens=out.num_tokens, **out.timings_ms)
    return step_to_proto(out, worker.info.instance_id)


class StepCalls:
    """Step and StepStream for the servicer. Once the server stops, the open streams end
    (a step already taken is refused as UNAVAILABLE, as a new unary call is): the step
    in flight finishes, and an open stream does not hold the stop for its grace."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._open: set[queue.Queue[_Arrival | None]] = set()  # the open streams' steps

    def stop(self) -> None:
        """Refuse every stream's next step, and end the streams waiting for one."""
        with self._lock:
            self._stopping.set()
            for arrived in self._open:
                arrived.put(None)

    def unary(self, request: worker_pb2.StepRequest, context: grpc.ServicerContext) -> worker_pb2.StepResponse:
        try:
            return run_step(self.worker, request)
        except StepRefused as refused:
            context.abort(refused.code, refused.details)
            raise  # abort raises; this keeps the type checker's flow honest

    def stream(self, requests: Iterator[worker_pb2.StepRequest]) -> Iterator[worker_pb2.StepReply]:
        """The replies, in the order of the steps. A reader thread takes the steps as they
        arrive and delivers the late masks riding along at once, as unary Step's own
        thread does: the step before may be running, waiting for them."""
        arrived: queue.Queue[_Arrival | None] = queue.Queue()
        with self._lock:
            if self._stopping.is_set():
                return
            self._open.add(arrived)
        threading.Thread(target=self._read, args=(requests, arrived), name="step-stream", daemon=True).start()
        try:
            while (item := arrived.get()) is not None:
                request, refused = item
                if self._stopping.is_set():
                    yield _refusal(grpc.StatusCode.UNAVAILABLE, "worker shutting down")
                    return
                try:
                    if refused is not None:
                        raise refused
                    yield worker_pb2.StepReply(response=run_step(self.worker, request))
                except StepRefused as why:
                    yield _refusal(why.code, why.details)
        finally:
            with self._lock:
                self._open.discard(arrived)

    def _read(
        self,
        requests: Iterator[worker_pb2.StepRequest],
        arrived: queue.Queue[_Arrival | None],
    ) -> None:
        try:
            for request in requests:
                arrived.put((request, self._deliver_riding_masks(request)))
        except grpc.RpcError:
            pass  # the call ended (cancelled, or the server stopped): nothing more arrives
        except Exception:  # a bug must not leave the stream hanging
            log.exception("step stream reader failed: the stream ends")
        finally:
            arrived.put(None)

    def _deliver_riding_masks(self, request: worker_pb2.StepRequest) -> StepRefused | None:
        """Delivers the previous step's late masks that ride in `request` (taking them out
        of it); the step's refusal if they are malformed."""
        if not (request.HasField("previous_step_masks") and request.HasField("previous_step_id")):
            return None  # none, or without the step they belong to: run_step refuses that
        try:
            masks = masks_from_proto("previous_step_masks", request.previous_step_masks)
            self.worker.deliver_masks(request.previous_step_id, masks, "previous_step_masks")
        except InvalidStep as exc:
            return StepRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        request.ClearField("previous_step_masks")
        return None


def _refusal(code: grpc.StatusCode, details: str) -> worker_pb2.StepReply:
    return worker_pb2.StepReply(refusal=worker_pb2.StepRefusal(code=code.name, details=details))
