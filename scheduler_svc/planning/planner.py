"""Step planner: which requests run this step, how many tokens each, in which slots.

vLLM-v1 style: a request has num_computed_tokens and a step schedules tokens,
not phases. A prefill chunk, a resumed (recomputed) request and a decode are the
same thing: the tokens in [num_computed_tokens, num_tokens) that fit the budget.
num_computed_tokens advances when a step is planned: it counts the tokens whose
KV is written or being written, so the next plan starts after them.

Protocol:
    plan = planner.schedule()      # retire -> free -> admit already happened
    samples = worker.step(plan)    # StepSamples: the sampled rows as columns
    updates = planner.update(plan, samples)
If a step is lost (worker error/restart), call requeue_all() instead of update().

The Planner composes one piece per job: queues.py (who waits, who runs, the
scheduling policy), admission.py (validation and admitting waiting requests),
budget.py (the step's token and row budget, the prefill chunk size),
preemption.py (slots taken from those who give way), inflight.py (the steps in
flight and planning ahead), hooks.py (the speculative and structured-output
hooks) and results.py (applying a step's results); plan.py holds the typed
objects of a step, config.py the settings.

Overlapped scheduling: while one plan is in flight, schedule() may plan the
next one ahead of its result. A request whose in-flight step samples a token
then decodes that token without knowing it (`token_from_previous_step`: the
worker takes it from its own last step). Such a plan never preempts; if
something does not fit it sets `deferred` and the caller lets the pipeline
drain, so preemption only happens with nothing in flight. A request that ends
in the earlier step (EOS, stop string, abort) has its speculative token
discarded by update() and its blocks freed once no step in flight holds it.

Speculative decoding (PlannerConfig.speculative; planning/speculation.py): a
decode of a request that drafts carries its input and up to K drafts, with
slots for them all; update() keeps the drafts the worker accepted and its token
after them, ends the request inside the run where EOS, a stop id or max_tokens
says so, and releases the slots of the rejected positions (KVManager.trim). A
request with drafts in flight is not planned ahead: its next input depends on
how many are accepted, and no step is planned ahead of a step with drafts
(can_plan_ahead), so a request that drafts can draft in every step.

Structured outputs: a request with a grammar (Request.grammar) samples under
its allowed-token mask. update() advances the grammar with each token it
appends, in step order, and ends the request with `stop` once the grammar is
complete (or with an error if the token was refused). A sampling row of such a
request carries its matcher (ScheduledSeq.grammar) for the engine to compute
the mask from: before the step is sent when the row's input is known
(StepPlan.masks), or, for a row planned ahead of its input token
(`mask_follows`), once the step in flight has been applied. With
`constrained_ahead` off such rows are not planned ahead at all.
"""

from __future__ import annotations

import math
import secrets
from collections import deque

from scheduler_svc.kv.block_manager import LeakError
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.lora.slots import AdapterSlots
from scheduler_svc.planning.admission import Admission
from scheduler_svc.planning.budget import StepBudget
from scheduler_svc.planning.config import PlannerConfig
from scheduler_svc.planning.hooks import DraftHooks, waits_for_its_grammar
from scheduler_svc.planning.inflight import InFlight
from scheduler_svc.planning.plan import (
    Alternatives,
    PlanMasks,
    PrefillProgress,
    RequestUpdate,
    ScheduledSeq,
    StepPlan,
    StepSamples,
    prompt_total,
)
from scheduler_svc.planning.pooling import returns_logits, row_pooling
from scheduler_svc.planning.preemption import Preemption
from scheduler_svc.planning.queues import QueueFull, RequestQueues
from scheduler_svc.planning.received import ReceivedKV
from scheduler_svc.planning.results import StepResults, check_samples
from scheduler_svc.planning.speculation import Drafter
from scheduler_svc.request import FinishReason, Request, RequestStatus

STEP_ID_BITS = 48  # two schedulers' first ids collide once in 2**48; uint64 on the wire

# The planner's API, with the typed objects of a step (plan.py) and its settings (config.py).
__all__ = [
    "Alternatives",
    "PlanMasks",
    "Planner",
    "PlannerConfig",
    "PrefillProgress",
    "QueueFull",
    "RequestUpdate",
    "ScheduledSeq",
    "StepPlan",
    "StepSamples",
]


def _prompt_logprob_targets(request: Request, start: int, end: int) -> list[int]:
    """The prompt tokens after the chunk [start, end)'s positions, while the request
    still needs prompt logprobs (positions already scored are asked again after a
    resume, and ignored: simpler than a second offset in the step)."""
    last = min(end, request.num_prompt_tokens - 1)
    if not request.needs_prompt_logprobs or start >= last:
        return []
    return request.prompt_token_ids[start + 1 : last + 1]


class Planner:
    def __init__(
        self, config: PlannerConfig, kv_cache_manager: KVManager, adapters: AdapterSlots | None = None
    ) -> None:
        """kv_cache_manager: the worker's KV memory as the KVManager protocol
        (scheduler_svc/kv/interface.py): paged blocks or contiguous slots. adapters: the
        worker's LoRA slots (--enable-lora): a request naming an adapter waits until the
        engine has loaded it, and its rows carry its slot."""
        self.config = config.validate()
        if config.block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {config.block_size} != KV cache block size {kv_cache_manager.block_size}")
        self.kv = kv_cache_manager
        # A request longer than the whole pool (or a contiguous slot) could never be resumed alone.
        self.max_len = min(config.max_model_len, kv_cache_manager.max_request_tokens)
        self.drafter = Drafter(config.speculative) if config.speculative is not None else None
        self._queues = RequestQueues(config.scheduling_policy, config.max_waiting)
        self._in_flight = InFlight()
        self.adapters = adapters
        self.received = ReceivedKV(self.kv)
        self._admission = Admission(config, self.kv, self._queues, self.received, adapters)
        self._preemption = Preemption(self.kv, self._queues)
        self._drafts = DraftHooks(self.drafter, self.kv, self._in_flight, self.max_len)
        self._results = StepResults(self.kv, self._queues, self.drafter, self.max_len, self.finish)
        # A random start, not 0: a worker outlives its scheduler (a restart, a standby taking
        # over, the tests' schedulers one after another in front of one worker), and it
        # matches a planned-ahead step's previous_step_id against the last step it ran.
        # Starting at 0, a new scheduler's step 1 could run right after the old
        # scheduler's step 0, before its own ("sampled nothing in step 0", seen in CI).
        self._next_step_id = secrets.randbits(STEP_ID_BITS)
        # Ids that hold blocks outside the queues: blocks a KV transfer writes into
        # (engine/disagg.py) until they are handed to `received`. Audited as live.
        self.held: set[str] = set()

    # ---- queue ----------------------------------------------------------
    @property
    def waiting(self) -> deque[Request]:
        return self._queues.waiting

    @property
    def running(self) -> list[Request]:
        """Admission order: oldest first."""
        return self._queues.running

    @property
    def requests(self) -> dict[str, Request]:
        """Live requests (waiting or running), by id."""
        return self._queues.requests

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_preemptions(self) -> int:
        return self._preemption.num_preemptions

    @property
    def resumed_tokens(self) -> int:
        """Tokens of preempted requests found in the prefix index on readmission."""
        return self._admission.resumed_tokens

    @property
    def recomputed_tokens(self) -> int:
        """Tokens of preempted requests computed again."""
        return self._admission.recomputed_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def idle(self) -> bool:
        """No live request, no step in flight, no ended request still holding blocks
        until its step comes back: nothing left for this worker to do (draining)."""
        return not (self.waiting or self.running) and self._in_flight.idle

    def add(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (never fits / bad args) or QueueFull."""
        self._admission.validate(request, self._in_use)
        self._queues.check_room()
        for child in request.children:
            self._admission.validate(child, self._in_use)
        self._queues.enqueue(request)

    def _in_use(self, request_id: str) -> bool:
        return request_id in self.requests or request_id in (r.request_id for r in self._in_flight.ended)

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """End a live request (abort, stop string). Its blocks are freed now, or by
        the update() of the step it is in flight in (whose result is then ignored)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        was_child, orphan = self._queues.unlink_pending_child(request)
        if orphan is not None:  # a parent left with no children has nothing to compute for
            self.finish(orphan, FinishReason.ABORT)
        if not was_child:
            self._queues.remove(request, reason)
            self._drafts.drop(request_id)
            self._in_flight.release(request, self.kv)
        self.received.release(request_id)
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        return True

    # ---- planning -------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step. With a step in flight, planned ahead of its result (see the module doc)."""
        budget = StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs, self._in_flight.ahead())
        preempted: list[str] = []
        self._schedule_running(budget, preempted, decodes=True)
        self._schedule_running(budget, preempted, decodes=False)
        # Right after a preemption memory is tight and the queue's head is the
        # request just preempted: admitting now would only thrash.
        if not preempted:
            self._admission.admit_waiting(budget)
        return self._build_plan(budget, preempted)

    @property
    def can_plan_ahead(self) -> bool:
        """One step is in flight and the next may be planned before its result. Not
        behind a step with drafts: its drafting requests go on drafting in the next
        step (planned ahead they would sit it out), and on a CPU a step's forward
        dwarfs what overlapping the plan saves."""
        return self._in_flight.can_plan_ahead

    def _schedule_running(self, budget: StepBudget, preempted: list[str], decodes: bool) -> None:
        """Decodes (one token left) of running requests, or else their next prefill chunks; oldest first."""
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.request_id in budget.scheduled:
                continue  # preempted earlier in this loop, or already has its tokens
            # < 0: its drafts are in flight, so its next input is not known yet.
            remaining = self._in_flight.known_end(request) - request.num_computed_tokens
            if remaining <= 0 or (remaining == 1) != decodes or self._in_flight.ends_in_flight(request, self.max_len):
                continue
            if decodes and request.hands_off(self._in_flight.pending(request.request_id)):
                continue  # disaggregation: it decodes on another worker
            if decodes and budget.ahead and self._drafts.waits_to_draft(request, len(self.running)):
                continue
            if budget.ahead and not self.config.constrained_ahead and waits_for_its_grammar(request, self._in_flight):
                continue
            if not budget.has_room():
                return
            want = min(remaining, self.config.chunk_limit(self.kv.free_fraction), budget.tokens_left)
            granted = self._drafts.reserve_drafts(request, budget, len(self.running)) if decodes else 0
            granted = granted or self._preemption.reserve_slots(request, want, budget, preempted)
            if granted:
                budget.add(request, granted)

    def _build_plan(self, budget: StepBudget, preempted: list[str]) -> StepPlan:
        # A plan made ahead runs on the worker only right after the step in flight
        # (and its decodes take their input from that step's samples).
        previous = self._in_flight.previous_step_id if budget.ahead else None
        plan = StepPlan(
            step_id=self._next_step_id,
            preempted=preempted,
            copies=self.kv.take_copies(),
            transfers=self.kv.take_transfers(),
            previous_step_id=previous,
            deferred=budget.deferred,
        )
        self._next_step_id += 1
        for request, num_tokens in budget.scheduled.values():
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            from_previous = start == request.num_tokens  # its input is sampled by the step in flight
            drafts = budget.drafts.get(request.request_id, [])
            sample = (end == self._in_flight.known_end(request) or bool(drafts)) and not request.prefill_only
            sample = sample and request.sampling.max_tokens > 0
            logits = returns_logits(request, end)
            scheduled = ScheduledSeq(
                request_id=request.request_id,
                seq_id=request.seq_id,
                token_ids=[0] if from_previous else request.all_token_ids[start:end] + drafts,
                start_pos=start,
                block_table=self.kv.block_table(request.request_id),
                slot_mapping=self.kv.slot_mapping(request, start, end),
                sample=sample or logits,
                sampling=request.sampling,
                token_from_previous_step=from_previous,
                prompt_logprob_targets=_prompt_logprob_targets(request, start, end),
                num_drafts=len(drafts),
                pooling=row_pooling(request, end),
                lora_slot=self.adapters.slot(request.lora) if self.adapters is not None else 0,
                return_logits=logits,
            )
            if sample:
                self._add_sample_inputs(scheduled, request)
                scheduled.grammar = request.grammar
                scheduled.mask_follows = request.grammar is not None and from_previous
                scheduled.position_masks = budget.draft_masks.get(request.request_id)
            plan.seqs.append(scheduled)
            request.num_computed_tokens = end
            if sample:
                self._in_flight.count_sample(request.request_id)
            if not request.output_token_ids:
                plan.prefill_progress.append(PrefillProgress(request.request_id, end, prompt_total(request)))
        if plan.seqs:
            self._in_flight.push(plan, {r.request_id: r for r, _ in budget.scheduled.values()})
        return plan

    def _add_sample_inputs(self, seq: ScheduledSeq, request: Request) -> None:
        """What the worker needs beyond the options to sample this request's next token
        (before this plan counts it as pending): the ids min_tokens still blocks, and
        the tokens the penalties look at."""
        s = request.sampling
        generated = request.num_output_tokens + self._in_flight.pending(request.request_id)
        if generated < s.min_tokens:
            stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(request.eos_token_ids))
            seq.blocked_token_ids = tuple(sorted(stops))
        if s.has_penalties:
            seq.penalty_output_ids = tuple(request.output_token_ids)
            if s.repetition_penalty != 1.0:
                seq.penalty_prompt_ids = request.distinct_prompt_ids

    # ---- results --------------------------------------------------------
    def update(self, plan: StepPlan, samples: StepSamples) -> list[RequestUpdate]:
        """Apply a step's results; one RequestUpdate per scheduled request still live.
        `samples` holds a row for each sampling sequence of the plan, and the
        alternatives and prompt logprobs the plan asked for.

        Finished requests are retired and their blocks freed here, so the next
        schedule() can hand those blocks to new requests.
        """
        self.kv.transfers_applied(plan.transfers)
        if not plan.seqs:
            return []  # an empty plan was never in flight
        requests = self._in_flight.oldest(plan)
        live = [(requests[s.request_id], s) for s in plan.seqs]
        live = [(r, s) for r, s in live if r.status is RequestStatus.RUNNING]
        check_samples(plan, live, samples)
        self._in_flight.retire(plan)
        updates: list[RequestUpdate] = []
        for request, seq in live:
            updates += self._results.apply(request, seq, samples)
        self._in_flight.free_ended(self.kv)
        return updates

    # ---- recovery and checks --------------------------------------------
    def requeue_all(self, reset_prefix_cache: bool = True) -> None:
        """The worker's cache cannot be trusted (a step was lost, it restarted):
        drop the step in flight, send every running request back to the front of
        the queue (oldest first) and, by default, forget all cached blocks."""
        self._in_flight.clear(self.kv)
        for request in reversed(self.running):
            self.kv.free(request)
            self._queues.to_front(request)
        self.running.clear()
        self.received.release_all()
        self.kv.transfers_lost()
        if reset_prefix_cache:
            self.kv.reset_prefix_cache()

    def hand_off(self, request_id: str) -> Request:
        """Take a running request off this worker (disaggregation: its KV was copied to
        the worker it goes to next): its blocks are freed, the full ones staying in the
        prefix cache, and it leaves waiting, with its outputs."""
        request = self.requests.pop(request_id)
        self._queues.remove(request, FinishReason.ABORT)  # a request that moves has no children
        self._drafts.drop(request_id)
        self._in_flight.release(request, self.kv)
        self.received.release(request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.kv_handoffs += 1
        return request

    def drain(self) -> list[Request]:
        """requeue_all(), then hand every live request over (oldest running first,
        then the waiting queue), e.g. to re-add them to another worker's planner."""
        self.requeue_all(reset_prefix_cache=True)
        drained = list(self.waiting)
        for request in drained:
            self._drafts.drop(request.request_id)
        self.waiting.clear()
        self.requests.clear()
        self._queues.pending_forks.clear()  # the drained parents carry their children along
        return drained

    def audit(self) -> None:
        """KV bookkeeping (KVCacheManager.audit) plus: waiting requests hold no
        blocks; running ones hold exactly the blocks their computed tokens need."""
        ended = [r.request_id for r in self._in_flight.ended]
        held = sorted(self.held) + self.received.held_ids
        self.kv.audit(live_request_ids=[r.request_id for r in self.running] + ended + held)
        problems = [f"waiting {r.request_id} holds blocks" for r in self.waiting if self.kv.block_table(r.request_id)]
        for request in self.running:
            have = len(self.kv.block_table(request.request_id))
            if have != math.ceil(request.num_computed_tokens / self.kv.block_size):
                problems.append(f"running {request.request_id}: {have} blocks for {request.num_computed_tokens} tokens")
        if problems:
            raise LeakError("planner audit failed:\n  " + "\n  ".join(problems))
