"""The worker's second KV tier (--kv-offload-gb): a pool of blocks laid out like
the cache's own tensors ([layers, blocks, ...] for K, V and any scales), which
the scheduler's offloads and onloads copy whole blocks into and out of. The
worker decides nothing: the ids come in the Step (TierCopies), checked by
step/validation.py.

Where it lives:
* --kv-offload-dir set: one file per tensor in that directory, mapped with
  torch.from_file(shared=True), so the page cache and the disk back it; the
  files are unlinked once mapped, so nothing outlives the process. A CPU
  worker's first tier is already host memory, so this is its second tier.
* otherwise (CUDA): pinned host memory. An offload gathers its blocks on the
  device on the compute stream (a snapshot taken before the step's forward
  writes them), then copies that snapshot to pinned staging on a side stream,
  so the transfer overlaps the forward; the staging is scattered into the pool
  before the pool is next read or written. An onload copies host -> device
  on the compute stream, before the forward that reads the blocks.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_svc.step.input import IntArray, TierCopies

log = structlog.get_logger(__name__)
GB = 10**9


@dataclass(slots=True)
class _PendingOffload:
    """A device -> host copy running on the side stream: scattered into the pool once done."""

    staged: list[torch.Tensor]
    dst: torch.Tensor
    done: torch.cuda.Event


class OffloadPool:
    def __init__(self, cache_tensors: tuple[torch.Tensor, ...], num_blocks: int, directory: str = "") -> None:
        """cache_tensors: the first tier's tensors (K, V, scales), each [layers, ids, ...]."""
        if num_blocks < 1:
            raise ValueError(f"an offload pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.cache = cache_tensors
        self.device = cache_tensors[0].device
        self.medium = "DISK" if directory else "CPU"
        tag = uuid.uuid4().hex[:12]
        self.tensors = [
            self._allocate((t.shape[0], num_blocks, *t.shape[2:]), t.dtype, directory, f"kv-offload-{tag}-{i}.bin")
            for i, t in enumerate(cache_tensors)
        ]
        cuda = self.device.type == "cuda" and not directory
        self._side = torch.cuda.Stream(self.device) if cuda else None  # type: ignore[no-untyped-call]
        self._pending: _PendingOffload | None = None
        log.info(
            "kv offload pool",
            medium=self.medium,
            blocks=num_blocks,
            gb=round(self.total_bytes / GB, 3),
            directory=directory or None,
        )

    @staticmethod
    def _allocate(shape: tuple[int, ...], dtype: torch.dtype, directory: str, name: str) -> torch.Tensor:
        numel = int(np.prod(shape))
        if not directory:
            return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        path = Path(directory) / name
        mapped = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        os.unlink(path)  # the mapping keeps the pages; no file is left behind
        return mapped.view(shape)

    @staticmethod
    def blocks_for(gb: float, block_bytes: int) -> int:
        return int(gb * GB) // block_bytes

    @property
    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def run(self, copies: TierCopies) -> dict[str, float]:
        """A step's tier copies, offloads then onloads: their wall times in ms."""
        timings: dict[str, float] = {}
        if len(copies.offloads):
            start = time.perf_counter()
            self._offload(copies.offloads[:, 0], copies.offloads[:, 1])
            timings["offload_ms"] = (time.perf_counter() - start) * 1e3
        if len(copies.onloads):
            start = time.perf_counter()
            self._onload(copies.onloads[:, 0], copies.onloads[:, 1])
            timings["onload_ms"] = (time.perf_counter() - start) * 1e3
        return timings

    def _offload(self, src: IntArray, dst: IntArray) -> None:
        self.finish()  # one copy in flight at a time, and its blocks may be overwritten now
        src_t = torch.from_numpy(src).to(self.device)
        dst_t = torch.from_numpy(dst)
        if self._side is None:
            for pool, cache in zip(self.tensors, self.cache):
                pool[:, dst_t] = cache[:, src_t].to("cpu")
            return
        snapshot = [cache[:, src_t] for cache in self.cache]  # on the compute stream: before the forward
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            staged = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) for s in snapshot]
            for host, device_copy in zip(staged, snapshot):
                host.copy_(device_copy, non_blocking=True)
                device_copy.record_stream(self._side)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._side)
        self._pending = _PendingOffload(staged, dst_t, done)

    def _onload(self, src: IntArray, dst: IntArray) -> None:
        self.finish()  # an onload may read a block an offload of this very step fills
        src_t = torch.from_numpy(src)
        dst_t = torch.from_numpy(dst).to(self.device)
        for pool, cache in zip(self.tensors, self.cache):
            cache[:, dst_t] = pool[:, src_t].to(self.device)

    def finish(self) -> None:
        """Wait for the offload in flight, if any, and land it in the pool."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        pending.done.synchronize()
        for pool, host in zip(self.tensors, pending.staged):
            pool[:, pending.dst] = host
