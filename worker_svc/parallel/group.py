"""A tensor-parallel worker's processes and collectives.

Rank 0 is the worker process: it serves worker.v1, validates every Step, and
starts ranks 1..N-1 as child processes (multiprocessing spawn). They meet in a
torch.distributed group (NCCL on CUDA, gloo on CPU; rendezvous through a
FileStore in a private temporary directory) for the forward's collectives.
Steps travel to the other ranks over one pipe each, pickled once: a rank
waiting for the next step blocks on its pipe with no timeout, and sees rank 0
go away as the pipe's end. The group knows nothing of the worker: `launch` is
handed the ranks' entry point (worker.run_rank), which builds each rank's
worker and runs rank.serve_rank.

Failure. A rank that exits (crash, OOM kill), or a step that fails on rank 0
after the others were sent it (their collectives may be waiting for it), makes
the group `failed`: every later step raises WorkerDown (the server answers
UNAVAILABLE), and the callbacks registered with `on_failure` run (the worker's
__main__ turns health NOT_SERVING and exits, so the scheduler handles it as a
dead worker). A rank other than 0 exits when its pipe ends or its own step
fails: rank 0 then notices its exit.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TypeVar

import structlog
import torch
import torch.distributed as dist

from worker_svc.step.errors import InvalidStep, WorkerDown
from worker_svc.step.input import StepInput

log = structlog.get_logger(__name__)

# How long ranks wait for each other to join, and for one collective of a step.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
READY = b"ready"
T = TypeVar("T")
# What rank 0 sends the ranks: a step, or another command every rank runs in the same
# order between steps (a LoRA slot update, worker_svc/lora/slots.py's SlotUpdate).
Item = TypeVar("Item")

# A rank's process: (rank, the group's init method, its end of rank 0's pipe). It
# must pickle (multiprocessing spawn): a module-level function, or a partial of one.
RankMain = Callable[[int, str, Connection], None]


@dataclass(frozen=True)
class GroupSpec:
    size: int  # ranks
    device: str  # cpu | cuda[:N]: rank r takes GPU N + r
    num_threads: int  # torch CPU threads for the whole worker, shared out over the ranks; 0 = torch's default


class TensorParallelGroup:
    def __init__(self, spec: GroupSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self.size = spec.size
        self.device = rank_device(spec.device, rank)
        self.failed: str | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._closing = False
        self._pipes: list[Connection] = []  # rank 0: one per other rank
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._store_dir = ""

    # ---- start-up -----------------------------------------------------------
    @classmethod
    def launch(cls, spec: GroupSpec, rank_main: RankMain) -> TensorParallelGroup:
        """Rank 0: start the other ranks (each runs `rank_main`, which builds its
        worker and joins the group) and join the group with them."""
        group = cls(spec, 0)
        group._store_dir = tempfile.mkdtemp(prefix="pagedserve-tp-")
        init_method = Path(group._store_dir, "store").as_uri()
        context = multiprocessing.get_context("spawn")
        for rank in range(1, group.size):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=rank_main, args=(rank, init_method, theirs), name=f"tp-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()
            group._pipes.append(ours)
            group._processes.append(process)
        # Watch them from now on: one that dies while the group forms must not leave rank 0 waiting.
        threading.Thread(target=group._watch, name="tp-watch", daemon=True).start()
        group._join(init_method)
        log.info("tensor-parallel ranks started", size=group.size, pids=group.pids, device=str(group.device))
        return group

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, init_method: str) -> TensorParallelGroup:
        """Ranks 1..N-1, in their own process."""
        group = cls(spec, rank)
        group._join(init_method)
        return group

    def _join(self, init_method: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (self.spec.num_threads or torch.get_num_threads()) // self.size))
            # the kernels' work pool (kernels/csrc/work_pool.cpp) would give each rank helpers
            # on the cores the other ranks' threads hold; read at its first use, after this
            os.environ["PAGEDSERVE_WORK_POOL"] = "0"
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=init_method,
            rank=self.rank,
            world_size=self.size,
            timeout=RENDEZVOUS_TIMEOUT,
        )

    @property
    def pids(self) -> list[int]:
        """The other ranks' process ids (rank 0's view)."""
        return [p.pid for p in self._processes if p.pid is not None]

    def wait_ready(self) -> None:
        """Rank 0: until every other rank has built its shard and cache."""
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                message = pipe.recv_bytes()
            except EOFError:
                raise WorkerDown(f"tensor-parallel rank {rank} exited while starting") from None
            if message != READY:
                raise WorkerDown(f"tensor-parallel rank {rank} failed to start: {message.decode(errors='replace')}")

    # ---- collectives (every rank calls them in the same order) ----------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0: every rank's `tensor`, in rank order; the others: None."""
        tensor = tensor.contiguous()
        if self.rank != 0:
            dist.gather(tensor, None, dst=0)
            return None
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.gather(tensor, parts, dst=0)
        return parts

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. the KV blocks each rank's GPU has
        room for: every rank must hold the same number)."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor.item())

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=0)
        return tensor

    # ---- steps ---------------------------------------------------------------
    def execute(self, run: Callable[[Item], T], step: Item) -> T:
        """Rank 0: hand the (validated) step, or a command, to every rank, `run` it here too."""
        if self.failed is not None:
            raise WorkerDown(self.failed)
        try:
            data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
            for pipe in self._pipes:
                pipe.send_bytes(data)
            return run(step)
        except InvalidStep:  # found before any rank touched anything, the same on every rank
            raise
        except Exception as exc:  # the other ranks may wait in a collective of this step forever
            what = f"step {step.step_id}" if isinstance(step, StepInput) else type(step).__name__
            reason = f"{what} failed on rank 0: {type(exc).__name__}: {exc}"
            self.fail(reason)
            raise WorkerDown(reason) from exc

    # ---- failure and shutdown ---------------------------------------------------
    def on_failure(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)
        if self.failed is not None:
            callback()

    def fail(self, reason: str) -> None:
        with self._lock:
            if self.failed is not None or self._closing:
                return
            self.failed = reason
            callbacks = list(self._callbacks)
        log.error("tensor-parallel worker failed: going down", reason=reason)
        if not callbacks:  # nobody can take the worker down cleanly (e.g. still starting): leave now
            os._exit(1)
        for callback in callbacks:
            callback()

    def _watch(self) -> None:
        """Rank 0: the first rank that exits fails the group (unless we are closing it)."""
        ready = wait([p.sentinel for p in self._processes])
        rank, process = next((r, p) for r, p in enumerate(self._processes, start=1) if p.sentinel in ready)
        process.join(1.0)
        self.fail(f"tensor-parallel rank {rank} (pid {process.pid}) exited with {process.exitcode}")

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop, wait for them, leave the group."""
        with self._lock:
            self._closing = True
        for pipe in self._pipes:
            try:
                pipe.send_bytes(pickle.dumps(None))
            except OSError:  # that rank is gone already
                pass
            pipe.close()
        for process in self._processes:
            process.join(10.0)
            if process.is_alive():
                process.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self._store_dir:
            shutil.rmtree(self._store_dir, ignore_errors=True)


def rank_device(device: str, rank: int) -> torch.device:
    """cpu for every rank; cuda[:N] gives rank r the GPU N + r."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)
