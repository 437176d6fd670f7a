"""Admission: whether a request may queue at all (validation.py's rules, plus the
limits of this planner's pool and config), and which waiting requests start in
the step being planned, their first chunk reusing what the prefix index holds."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.lora.slots import AdapterSlots
from scheduler_svc.planning.budget import StepBudget
from scheduler_svc.planning.config import PlannerConfig
from scheduler_svc.planning.queues import RequestQueues
from scheduler_svc.planning.received import ReceivedKV
from scheduler_svc.planning.validation import (
    RequestRejected,
    check_constrained,
    check_priority,
    check_prompt_fits,
    check_prompt_ids,
    check_sampling,
)
from scheduler_svc.request import Request, RequestStatus


class Admission:
    def __init__(
        self,
        config: PlannerConfig,
        kv: KVManager,
        queues: RequestQueues,
        received: ReceivedKV,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.queues = queues
        self.received = received  # blocks a KV transfer wrote for a waiting request: its prefix
        self.adapters = adapters  # the worker's LoRA slots: a request starts once its adapter is resident
        self.resumed_tokens = 0  # tokens of preempted requests found in the prefix index on readmission
        self.recomputed_tokens = 0  # tokens of preempted requests computed again

    def validate(self, request: Request, in_use: Callable[[str], bool]) -> None:
        check_priority(request.priority, self.config.scheduling_policy)
        if in_use(request.request_id):
            raise RequestRejected("request_id", f"{request.request_id!r} is already in use")
        check_prompt_ids(request.prompt_token_ids, vocab_size=None)
        capacity, blocks, size = self.kv.max_request_tokens, self.kv.pool.num_blocks, self.kv.block_size
        layout = f"{blocks} blocks x {size}" if capacity == blocks * size else f"one slot of {size} per request"
        check_prompt_fits(request.num_prompt_tokens, self.config.max_model_len, capacity, layout)
        check_sampling(request.sampling, prefill_only=request.pooling is not None)
        if request.grammar is not None:
            check_constrained(request.sampling)
        if request.lora is not None and self.adapters is None:
            raise RequestRejected(
                "lora_adapter", "this scheduler serves no LoRA adapters (start it with --enable-lora)"
            )

    def admit_waiting(self, budget: StepBudget) -> None:
        """Admission in policy order; stops at the first request whose chunk does not
        fit, so a big request at the head is not starved by smaller ones behind it."""
        queues = self.queues
        while queues.waiting and budget.has_room() and len(queues.running) < self.config.max_num_seqs:
            request = queues.next_waiting(self._ready)
            if request is None:
                return
            hits, num_hit_tokens = self.received.prefix(request, *self.kv.get_computed_blocks(request))
            want = min(
                request.num_tokens - num_hit_tokens, self.config.chunk_limit(self.kv.free_fraction), budget.tokens_left
            )
            if self.kv.allocate_slots(request, want, hits) is None:
                budget.deferred = budget.deferred or budget.ahead
                return
            queues.waiting.remove(request)
            self.received.release(request.request_id)  # its table shares them now
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0 and not request.kv_handoffs:  # a moved KV is no hit of its own
                request.num_cached_prompt_tokens = num_hit_tokens
                self.kv.record_prefix_lookup(request, num_hit_tokens)
            else:
                # A resumed request: its committed blocks come back from the index;
                # only the rest is computed again.
                self.resumed_tokens += num_hit_tokens
                self.recomputed_tokens += request.num_tokens - num_hit_tokens
            request.status = RequestStatus.RUNNING
            queues.running.append(request)
            budget.add(request, want)
            if self.adapters is not None:
                self.adapters.touch(request.lora)

    def _ready(self, request: Request) -> bool:
        return request.lora is None or (self.adapters is not None and self.adapters.admits(request.lora))
