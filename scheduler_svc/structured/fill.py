"""Masks for many rows at once, off the event loop.

MaskFiller computes the rows on a thread of its own (llguidance drops the GIL
while it computes a mask), so the event loop awaits the masks and keeps
serving (planning, streaming, other replies) meanwhile; llguidance's
parallel fill spreads the rows over its own thread pool. The rows come back as one [rows, W] int32 array,
the layout of the Step's mask column (bitmask.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import llguidance.numpy
import numpy as np
from numpy.typing import NDArray

from scheduler_svc.structured.matcher import GrammarMatcher

# Below this many rows one thread is quicker than handing work to the pool.
PARALLEL_MIN_ROWS = 4


@dataclass
class MaskRows:
    bits: NDArray[np.int32]  # [rows, W], row i for matchers[i]
    errors: dict[int, str]  # row -> why its grammar failed (the request ends with an error; its row is void)


def default_threads() -> int:
    """Parallel fill threads: 80% of the cores as llguidance picks, at most 32, but at least 2: a pool
    of one thread only adds a hand-off to the serial loop (bench/results/structured_masks.md)."""
    return max(2, min(32, (os.cpu_count() or 1) * 4 // 5))


class MaskFiller:
    def __init__(self, mask_words: int, threads: int | None = None) -> None:
        """`threads`: llguidance's parallel fill on that many threads; 0: rows one after another."""
        self.mask_words = mask_words
        self.threads = default_threads() if threads is None else threads
        self._executor = llguidance.LLExecutor(num_threads=self.threads) if self.threads else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")

    def fill(self, matchers: Sequence[GrammarMatcher]) -> MaskRows:
        """Blocking: the next masks of `matchers` (each must need one)."""
        assert all(m.needs_mask for m in matchers), "fill masks only for rows that need one"
        bits = np.empty((len(matchers), self.mask_words), np.int32)
        if self._executor is not None and len(matchers) >= PARALLEL_MIN_ROWS:
            rows = [(m.llguidance_matcher, i) for i, m in enumerate(matchers)]
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, bits)
        else:
            for i, m in enumerate(matchers):
                m.fill_mask(bits[i])
        errors = {i: error for i, m in enumerate(matchers) if (error := m.error) is not None}
        return MaskRows(bits, errors)

    async def fill_async(self, matchers: Sequence[GrammarMatcher]) -> MaskRows:
        """The same on the filler's thread; the matchers must not be advanced until it returns."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.fill, list(matchers))

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
