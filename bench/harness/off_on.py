"""A run-time switch measured side by side: the same work with it off and on, round by
round, which setting goes first alternating, so that a machine whose speed drifts
(other tenants, clocks) moves both settings alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def off_and_on(switch: Callable[[bool], object], run: Callable[[], T], rounds: int) -> dict[bool, list[T]]:
    """`run()` once per setting to warm, then `rounds` times per setting, alternating which
    goes first; the switch is left on. Each setting's results, in order."""
    results: dict[bool, list[T]] = {False: [], True: []}
    for on in (False, True):
        switch(on)
        run()
    for r in range(rounds):
        for on in (r % 2 == 0, r % 2 == 1):
            switch(on)
            results[on].append(run())
    switch(True)
    return results
