"""Late masks (structured outputs): the allowed-token bitmasks of a step's rows
flagged SEQ_FLAG_MASK_FOLLOWS, which the scheduler sends in a StepMasks call
once it knows the tokens they follow (a step planned ahead). The step runs its
forward meanwhile and takes them here only at sampling.

Like LastSamples, this is state of the step at hand, not of any request: the
masks of a step or two, keyed by step id, dropped once a later step has taken
its own."""

from __future__ import annotations

import threading

from worker_svc.step.errors import StaleStep
from worker_svc.step.input import TokenMasks

# How long sampling waits for a step's masks (as long as a step waits for the one it follows).
MASKS_WAIT_S = 5.0
_KEEP = 4  # masks of steps not taken yet (a step that failed before taking its own leaves them)


class LateMasks:
    def __init__(self, wait_s: float = MASKS_WAIT_S) -> None:
        self.wait_s = wait_s
        self._ready = threading.Condition()
        self._masks: dict[int, tuple[TokenMasks, str]] = {}  # step id -> (masks, the field they came in)

    def put(self, step_id: int, masks: TokenMasks, field_name: str) -> None:
        with self._ready:
            self._masks[step_id] = (masks, field_name)
            # The oldest put go first, not the lowest ids: a new scheduler's step ids
            # start anywhere (planner.py), below what a previous one left.
            for old in list(self._masks)[:-_KEEP]:
                del self._masks[old]
            self._ready.notify_all()

    def take(self, step_id: int) -> tuple[TokenMasks, str]:
        """Step `step_id`'s masks and the field they came in, waiting up to wait_s for them;
        StaleStep if they never came."""
        with self._ready:
            if not self._ready.wait_for(lambda: step_id in self._masks, timeout=self.wait_s):
                raise StaleStep(
                    f"step {step_id}: the masks of its SEQ_FLAG_MASK_FOLLOWS rows did not come within {self.wait_s:g} s"
                )
            masks = self._masks.pop(step_id)
            for old in [s for s in self._masks if s < step_id]:
                del self._masks[old]
            return masks
