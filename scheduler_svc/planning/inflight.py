"""Planning ahead: the steps sent and not yet applied, and what they leave unknown.

Overlapped scheduling plans the next step while one is in flight (at most two
steps are: the oldest and one planned ahead of its result). A request that the
step in flight samples has a last token nobody knows yet: its next decode takes
that token from the worker's own last step (token_from_previous_step). A request
that ends while a step in flight still holds it keeps its blocks until that
step's update(), so the worker never writes into blocks handed to someone else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.planning.plan import StepPlan
from scheduler_svc.request import Request


@dataclass(slots=True)
class _Step:
    plan: StepPlan
    requests: dict[str, Request]  # the requests it was planned for, by id


class InFlight:
    def __init__(self) -> None:
        self._steps: deque[_Step] = deque()  # oldest first
        self._ended: list[Request] = []  # ended while in flight: blocks freed on update()
        # Request id -> in-flight steps that sample it: its last token is not known yet.
        self._pending_samples: dict[str, int] = {}

    # ---- the steps ------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No step in flight and no ended request still holding blocks."""
        return not (self._steps or self._ended)

    def ahead(self) -> bool:
        """A step is in flight, so the next plan is planned ahead of its result;
        raises if two already are."""
        if len(self._steps) > 1:
            raise RuntimeError("two steps are in flight: update() the oldest before planning another")
        return bool(self._steps)

    @property
    def previous_step_id(self) -> int | None:
        """The step a plan made now runs right after (None: nothing in flight)."""
        return self._steps[-1].plan.step_id if self._steps else None

    @property
    def can_plan_ahead(self) -> bool:
        """One step is in flight, it did not defer, and it carries no drafts (see Planner.can_plan_ahead)."""
        if len(self._steps) != 1:
            return False
        plan = self._steps[0].plan
        return not plan.deferred and not any(seq.num_drafts for seq in plan.seqs)

    def push(self, plan: StepPlan, requests: dict[str, Request]) -> None:
        self._steps.append(_Step(plan, requests))

    def oldest(self, plan: StepPlan) -> dict[str, Request]:
        """The requests of `plan`, which must be the oldest step in flight."""
        if not self._steps or plan is not self._steps[0].plan:
            raise RuntimeError(f"update() got step {plan.step_id}, which is not the oldest step in flight")
        return self._steps[0].requests

    def retire(self, plan: StepPlan) -> None:
        """The oldest step's result is being applied: its samples are no longer pending."""
        self._steps.popleft()
        for seq in plan.seqs:
            if seq.sample:
                left = self._pending_samples.pop(seq.request_id, 0) - 1
                if left > 0:
                    self._pending_samples[seq.request_id] = left

    def clear(self, kv: KVManager) -> None:
        """Forget every step in flight (lost with the worker's cache); free the ended requests."""
        self._steps.clear()
        self._pending_samples.clear()
        self.free_ended(kv)

    # ---- what a request's steps in flight leave unknown ---------------------
    def pending(self, request_id: str) -> int:
        """In-flight steps that sample the request."""
        return self._pending_samples.get(request_id, 0)

    def count_sample(self, request_id: str) -> None:
        self._pending_samples[request_id] = self.pending(request_id) + 1

    def known_end(self, request: Request) -> int:
        """Tokens of the request once the steps in flight are applied: its own, plus
        one per in-flight step that samples it."""
        return request.num_tokens + self.pending(request.request_id)

    def ends_in_flight(self, request: Request, max_len: int) -> bool:
        """The token sampled in flight will reach max_tokens or the length limit:
        planning past it would only be discarded."""
        pending = self.pending(request.request_id)
        return pending > 0 and (
            request.num_output_tokens + pending >= request.sampling.max_tokens
            or request.num_tokens + pending >= max_len
        )

    # ---- ended requests' blocks -------------------------------------------
    def holds(self, request: Request) -> bool:
        return any(step.requests.get(request.request_id) is request for step in self._steps)

    @property
    def ended(self) -> list[Request]:
        """Ended requests whose blocks wait for the step in flight that holds them."""
        return list(self._ended)

    def release(self, request: Request, kv: KVManager) -> None:
        """An ended request's blocks: freed now, or once no step in flight holds it."""
        if self.holds(request):
            self._ended.append(request)
        else:
            kv.free(request)

    def free_ended(self, kv: KVManager) -> None:
        """Free the ended requests that no step in flight holds any more."""
        still = [r for r in self._ended if self.holds(r)]
        for request in self._ended:
            if request not in still:
                kv.free(request)
        self._ended = still
