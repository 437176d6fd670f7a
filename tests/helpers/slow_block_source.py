"""`python -m tests.helpers.slow_block_source ARGS`: the real worker whose ReadBlocks
waits PAGEDSERVE_TEST_READ_DELAY_S seconds before its first chunk, so that a test can
kill it while a decode worker is pulling its blocks (a transfer caught mid-way)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from worker_svc.__main__ import main
from worker_svc.kv_transfer.chunk import Chunk
from worker_svc.kv_transfer.mover import BlockMover


def _delay(seconds: float) -> None:
    real = BlockMover._chunks

    def chunks(self: BlockMover, ids: list[int]) -> Iterator[Chunk]:
        time.sleep(seconds)
        yield from real(self, ids)

    BlockMover._chunks = chunks  # type: ignore[method-assign]


if __name__ == "__main__":
    _delay(float(os.environ["PAGEDSERVE_TEST_READ_DELAY_S"]))
    main()
