"""Preemption: slots for a request's tokens, taken from the running requests that
give way (the scheduling policy's victim) when the pool has none left. A
preempted request releases all its blocks and goes back to the head of the
queue; its outputs are kept, and on resume prompt + outputs are computed again,
mostly as prefix-cache hits. A plan made ahead never preempts (a victim may be
in flight): it defers, and the caller drains the pipeline first."""

from __future__ import annotations

import structlog

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.planning.budget import StepBudget
from scheduler_svc.planning.queues import RequestQueues
from scheduler_svc.request import Request

log = structlog.get_logger(__name__)


class Preemption:
    def __init__(self, kv: KVManager, queues: RequestQueues) -> None:
        self.kv = kv
        self.queues = queues
        self.num_preemptions = 0

    def reserve_slots(self, request: Request, want: int, budget: StepBudget, preempted: list[str]) -> int:
        """Slots for up to `want` tokens: a smaller chunk if that is all that fits,
        else preempt the newest running request not yet scheduled this step until
        something fits. Returns tokens granted; 0 if the request itself got preempted."""
        while True:
            num_tokens = min(want, self.kv.num_tokens_fitting(request))
            if num_tokens > 0 and self.kv.allocate_slots(request, num_tokens) is not None:
                return num_tokens
            if budget.ahead:  # a victim may be in flight: preempt only with nothing in flight
                budget.deferred = True
                return 0
            victim = self.queues.victim(budget.scheduled)
            self.preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return 0

    def preempt(self, request: Request) -> None:
        """Release all blocks and requeue at the front."""
        self.kv.free(request)
        self.queues.running.remove(request)
        self.queues.to_front(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        log.info(
            "request_preempted",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            free_blocks=self.kv.usage().free_blocks,
            total_preemptions=self.num_preemptions,
        )
