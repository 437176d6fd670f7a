"""The event loop the asyncio services (scheduler, gateway) run on: uvloop, libuv's loop.

At one stream the scheduler's and the gateway's loops wake several times per token (the
Step call's completions through grpc.aio's poller, the Generate stream's write, the SSE
chunk), and on a 2-core machine every millisecond they spend is taken from the worker's
step; uvloop runs the same callbacks for less CPU than asyncio's pure-Python loop
(bench/results/itl_split.md measures both side by side). PAGEDSERVE_EVENT_LOOP=asyncio
keeps the standard loop (to compare, or should a library misbehave on uvloop).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "PAGEDSERVE_EVENT_LOOP"
LOOPS = ("uvloop", "asyncio")


def chosen() -> str:
    """The loop PAGEDSERVE_EVENT_LOOP names (uvloop when unset); anything else is refused by name."""
    name = os.environ.get(ENV, "") or LOOPS[0]
    if name not in LOOPS:
        raise ValueError(f"{ENV}: must be one of {', '.join(LOOPS)}, got {name!r}")
    return name


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the chosen loop."""
    if chosen() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
