"""Admission and queues: who is waiting, who runs, and the scheduling policy that
orders them (--scheduling-policy). fcfs: admission in arrival order, the newest
running request gives way first; priority: by (priority, arrival) both ways.
A request with n > 1 samples is a prefill-only parent whose children wait here
until its prompt is computed, then take over its blocks."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.request import FinishReason, Request, RequestStatus


class QueueFull(RuntimeError):
    """max_waiting requests are already queued (RESOURCE_EXHAUSTED)."""


def _urgency(request: Request) -> tuple[int, int]:
    """Ordering under the priority policy: lower priority values first, then arrival."""
    return request.priority, request.arrival_index


class RequestQueues:
    def __init__(self, policy: str, max_waiting: int) -> None:
        self.policy = policy
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.requests: dict[str, Request] = {}  # live = waiting or running
        self.pending_forks: dict[str, list[Request]] = {}  # parent id -> children waiting for its prefill
        self._next_arrival = 0

    def check_room(self) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests waiting (max_waiting={self.max_waiting})")

    def enqueue(self, request: Request) -> None:
        """A validated request joins the waiting queue; its children wait for its prefill."""
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.children:
            self.pending_forks[request.request_id] = list(request.children)
            for child in request.children:
                child.status, child.arrival_index = RequestStatus.WAITING, request.arrival_index
                self.requests[child.request_id] = child

    def to_front(self, request: Request) -> None:
        """Back to the head of the queue, to be computed again (its blocks are released)."""
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    # ---- ending ---------------------------------------------------------
    def unlink_pending_child(self, request: Request) -> tuple[bool, str | None]:
        """Drop a child still waiting for its parent's prefill: (it was one, the parent
        left with no children, which has nothing to compute for and must end too)."""
        for parent_id, children in self.pending_forks.items():
            if request in children:
                children.remove(request)
                if not children:
                    del self.pending_forks[parent_id]
                    return True, parent_id
                return True, None
        return False, None

    def remove(self, request: Request, reason: FinishReason) -> None:
        """Take a waiting or running request out; its children still waiting for its
        prefill end with it (they hold no blocks)."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        for child in self.pending_forks.pop(request.request_id, []):
            self.requests.pop(child.request_id, None)
            child.status, child.finish_reason = RequestStatus.FINISHED, reason

    def start_children(self, parent: Request, kv: KVManager) -> None:
        """The parent's prompt is computed: its children take over its blocks
        (shared, ref +1 each) and run."""
        for child in self.pending_forks.pop(parent.request_id, []):
            kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)

    # ---- the scheduling policy: who goes first, who gives way ---------------
    def next_waiting(self, ready: Callable[[Request], bool]) -> Request | None:
        """The waiting request admitted next among those `ready` (a LoRA request waits
        for its adapter's slot without holding up the others): the first in the queue
        (fcfs: arrival order, a preempted request back at the front), or the most urgent
        (priority: lowest value, then earliest arrival)."""
        candidates = (r for r in self.waiting if ready(r))
        if self.policy == "priority":
            return min(candidates, key=_urgency, default=None)
        return next(candidates, None)

    def victim(self, spared: Iterable[str]) -> Request:
        """The running request to preempt, among those not spared (scheduled this step):
        the newest (fcfs), or the least urgent (priority: highest value, then latest arrival)."""
        exclude = set(spared)
        candidates = [r for r in self.running if r.request_id not in exclude]
        if self.policy == "priority":
            return max(candidates, key=_urgency)
        return candidates[-1]
