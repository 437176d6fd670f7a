"""A step sent to the worker and not yet applied (an EngineCore keeps up to two,
one planned ahead), with the late masks of its rows planned ahead of their
input; and how steps whose results no longer count are waited out."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from scheduler_svc.engine import masks
from scheduler_svc.engine.worker_client import StepResult, WorkerClient
from scheduler_svc.planning.plan import PlanMasks, StepPlan
from scheduler_svc.structured.grammars import Grammars


@dataclass(slots=True)
class SentStep:
    plan: StepPlan
    started: float  # perf_counter when it was planned (its inline masks computed, then sent)
    call: asyncio.Task[StepResult]
    # Its mask_follows rows' masks: being computed (once the step before it is applied), then
    # delivered with the next step or in their own StepMasks call (masks_call).
    late_masks: asyncio.Task[PlanMasks] | None = None
    masks_delivered: bool = False
    masks_call: asyncio.Task[None] | None = None
    mask_ms: float = 0.0  # its masks (inline and late): from handing the rows to the filler to having them


async def abandon(steps: deque[SentStep], client: WorkerClient, grammars: Grammars | None) -> None:
    """Wait out steps whose results no longer count: the worker runs a step only
    right after the one it names, so none of them can land after a new plan. One
    still waiting for its late masks gets masks that allow everything, so the
    worker is not held up waiting for them."""
    for step in steps:
        if not step.masks_delivered and (rows := step.plan.late_mask_rows) and grammars is not None:
            if step.late_masks is not None:
                step.late_masks.cancel()
            void = masks.allowing_all(step.plan, rows, grammars.mask_words)
            step.masks_call = asyncio.create_task(client.step_masks(step.plan.step_id, void))
            step.masks_delivered = True
        if not step.call.done():
            step.call.cancel()
    tasks = (task for step in steps for task in (step.call, step.late_masks, step.masks_call))
    calls = [task for task in tasks if task is not None]
    await asyncio.gather(*calls, return_exceptions=True)
    steps.clear()
