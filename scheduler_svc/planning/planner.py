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
from collections import deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np
import structlog
from numpy.typing import NDArray

from scheduler_svc.kv.block_manager import LeakError
from scheduler_svc.kv.interface import KVManager
from scheduler_svc.planning.speculation import Drafter
from scheduler_svc.planning.validation import (
    SCHEDULING_POLICIES,
    RequestRejected,
    check_constrained,
    check_priority,
    check_prompt_fits,
    check_prompt_ids,
    check_sampling,
)
from scheduler_svc.request import FinishReason, Request, RequestStatus, SamplingOptions, TokenLogprob
from scheduler_svc.speculative.ngram import NgramConfig
from scheduler_svc.structured.errors import GrammarFailed, TokenRejected

if TYPE_CHECKING:
    from scheduler_svc.structured.matcher import GrammarMatcher

log = structlog.get_logger(__name__)


class QueueFull(RuntimeError):
    """max_waiting requests are already queued (RESOURCE_EXHAUSTED)."""


@dataclass(slots=True)
class PlannerConfig:
    max_num_batched_tokens: int = 8192  # tokens per step, all sequences together
    max_num_seqs: int = 256  # sequences per step, and running at once
    chunk_size: int = 8192  # largest prefill chunk of one request per step
    max_model_len: int = 8192  # prompt + output tokens of one request
    max_waiting: int = 1024
    block_size: int = 16
    # Dynamic chunking: the prefill chunk shrinks from max to min as free KV
    # blocks run out (less memory taken per step while the pool is tight) and
    # grows back when plenty are free. Off: every chunk is up to chunk_size.
    dynamic_chunking: bool = False
    dynamic_chunk_min: int = 512
    dynamic_chunk_max: int = 2048
    speculative: NgramConfig | None = None  # n-gram drafts (speculation.can_draft: whose); None: off
    # Structured outputs: plan a constrained request's decode ahead of the token it
    # follows (its mask is sent late, once that token is known); off: such a decode
    # waits for the next plan made with nothing in flight ahead of it.
    constrained_ahead: bool = True
    # fcfs: admission in arrival order, the newest running request preempted first;
    # priority: by (priority, arrival) both ways (vLLM's --scheduling-policy).
    scheduling_policy: str = "fcfs"

    _MINIMUMS = {"max_model_len": 2}  # a prompt token plus a generated one

    def validate(self) -> PlannerConfig:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy (--scheduling-policy) must be one of {', '.join(SCHEDULING_POLICIES)}")
        for f in fields(self):
            value, low = getattr(self, f.name), self._MINIMUMS.get(f.name, 1)
            flag = "--" + f.name.replace("_", "-")
            if f.name in ("dynamic_chunking", "constrained_ahead", "scheduling_policy", "speculative"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"{f.name} ({flag}) must be an integer >= {low} (valid range [{low}, inf)), got {value!r}"
                )
        if self.dynamic_chunk_min > self.dynamic_chunk_max:
            raise ValueError(
                f"dynamic_chunk_min (--dynamic-chunk-min) {self.dynamic_chunk_min} must be <= "
                f"dynamic_chunk_max (--dynamic-chunk-max) {self.dynamic_chunk_max} "
                f"(valid range [1, {self.dynamic_chunk_max}])"
            )
        if self.speculative is not None and (problems := self.speculative.problems()):
            raise ValueError("; ".join(problems))
        return self

    def chunk_limit(self, free_fraction: float) -> int:
        """Largest prefill chunk of one request this step, given the free share of the pool."""
        if not self.dynamic_chunking:
            return self.chunk_size
        span = self.dynamic_chunk_max - self.dynamic_chunk_min
        size = self.dynamic_chunk_min + int(span * max(0.0, min(1.0, free_fraction)))
        # Whole blocks: a chunk that ends mid-block wastes nothing, but aligned
        # chunks keep every committed chunk fully in the prefix index.
        return max(self.dynamic_chunk_min, size - size % self.block_size)


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: one row of worker.v1.SeqColumns."""

    request_id: str
    seq_id: int
    token_ids: list[int]  # a prefill chunk, or one decode token
    start_pos: int  # tokens of this sequence already in cache
    block_table: list[int]  # physical blocks for [0, start_pos + len(token_ids))
    slot_mapping: list[int]  # block * block_size + offset, one per token
    sample: bool  # the chunk reaches the last known token: sample the next one
    sampling: SamplingOptions
    # The one input token is the one this sequence samples in the step in
    # flight before this one (token_ids then holds a placeholder).
    token_from_previous_step: bool = False
    # Prompt logprobs: the prompt token after each of the chunk's first len(...) positions.
    prompt_logprob_targets: list[int] = field(default_factory=list)
    # Tokens the sample may not pick (min_tokens not reached: EOS and stop ids).
    blocked_token_ids: tuple[int, ...] = ()
    # Penalties: the tokens generated before this sample (a token_from_previous_step
    # input is counted by the worker) and the prompt's distinct ids (repetition only).
    penalty_output_ids: tuple[int, ...] = ()
    penalty_prompt_ids: tuple[int, ...] = ()
    num_drafts: int = 0  # the last num_drafts of token_ids are drafts for the worker to verify
    # Structured outputs (sampling rows of a request with a grammar): the matcher the
    # row's mask comes from, and whether that mask follows the step (the input is
    # token_from_previous_step, so the matcher is one token behind until it is applied).
    grammar: GrammarMatcher | None = None
    mask_follows: bool = False
    # A constrained row with drafts: the mask of each verified position, [num_drafts + 1, W]
    # (row i: after the input and i drafts; the last is the sampled position's), computed
    # when planned (speculation.constrained_drafts); None: unconstrained or no drafts.
    position_masks: NDArray[np.int32] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True, frozen=True)
class PrefillProgress:
    request_id: str
    processed: int  # prompt tokens computed once this step is done (cache hits included)
    total: int  # prompt tokens


@dataclass(slots=True)
class PlanMasks:
    """Allowed-token masks of some sampling rows of a plan (worker.v1 TokenMasks)."""

    rows: list[int]  # indexes into StepPlan.seqs, ascending
    words: NDArray[np.int32]  # [len(rows), W]


@dataclass(slots=True)
class StepPlan:
    step_id: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies, done first
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes first, then prefill chunks
    prefill_progress: list[PrefillProgress] = field(default_factory=list)  # first prefill only
    preempted: list[str] = field(default_factory=list)  # request ids preempted while planning
    previous_step_id: int | None = None  # planned ahead of this step's result (overlapped scheduling)
    deferred: bool = False  # planned ahead, something did not fit: drain the pipeline before the next plan
    masks: PlanMasks | None = None  # set by the engine before sending: the masks of rows whose input is known
    # Set by the engine: the late masks of step previous_step_id (its mask_follows rows), taken along.
    previous_masks: PlanMasks | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(seq.token_ids) for seq in self.seqs)

    @property
    def late_mask_rows(self) -> list[int]:
        """The rows whose masks follow the step."""
        return [row for row, seq in enumerate(self.seqs) if seq.mask_follows]

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.copies


Alternatives = tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass(slots=True)
class StepSamples:
    """What a step sampled, as the worker answered it: one row per sampling sequence,
    as columns in the worker's row order (a sequence finds its row by seq_id), and
    the rarely asked extras only for the rows that asked."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top: dict[int, Alternatives] = field(default_factory=dict)  # seq_id -> the sampled token's alternatives
    # seq_id -> one (logprob, alternatives) per ScheduledSeq.prompt_logprob_targets entry
    prompt: dict[int, list[tuple[float, Alternatives]]] = field(default_factory=dict)
    # Per row: drafts accepted, token_ids[row] following them (empty: the step carried none),
    # and the accepted drafts' logprobs, row after row.
    num_accepted: list[int] = field(default_factory=list)
    draft_logprobs: list[float] = field(default_factory=list)
    rows: dict[int, int] = field(init=False, repr=False)  # seq_id -> row

    def __post_init__(self) -> None:
        self.rows = dict(zip(self.seq_ids, range(len(self.seq_ids))))

    def accepted(self, row: int) -> tuple[int, list[float]]:
        """(drafts accepted, their logprobs) of a row."""
        if not self.num_accepted:
            return 0, []
        start = sum(self.num_accepted[:row])  # only drafting rows ask: a few per step
        count = self.num_accepted[row]
        return count, self.draft_logprobs[start : start + count]


@dataclass(slots=True)
class RequestUpdate:
    """What one step did for one request: the planner's answer to the engine, which
    streams it to the request's client. A step samples at most one token per request."""

    request_id: str
    token_id: int | None = None  # sampled this step
    logprob: float = 0.0  # the token's
    top_logprobs: Alternatives | None = None  # the token's alternatives, with sampling.logprobs
    # With sampling.prompt_logprobs: prompt tokens 1.. (the first has none), once, with the
    # first token (or the end of a request that scores the prompt only).
    prompt_logprobs: list[TokenLogprob] | None = None
    prefill_progress: tuple[int, int] | None = None  # (processed, total) for a chunk that sampled nothing
    finished: bool = False
    finish_reason: FinishReason | None = None
    forked: bool = False  # a prefill-only parent finished: its children now run
    # Set on the tokens of an accepted run of drafts: the request's outputs once this
    # token is in (a stop string found here drops the run's later tokens).
    num_output_tokens: int = 0
    # The request ended with this error instead (its grammar refused the token: TokenRejected,
    # or hit a limit: GrammarFailed); the token is not in its outputs.
    error: Exception | None = None


def _urgency(request: Request) -> tuple[int, int]:
    """Ordering under the priority policy: lower priority values first, then arrival."""
    return request.priority, request.arrival_index


def _prompt_total(request: Request) -> int:
    """Prompt tokens as the client sees them: a fork parent holds all but the last."""
    return request.num_prompt_tokens + (1 if request.prefill_only else 0)


def _prompt_logprob_targets(request: Request, start: int, end: int) -> list[int]:
    """The prompt tokens after the chunk [start, end)'s positions, while the request
    still needs prompt logprobs (positions already scored are asked again after a
    resume, and ignored: simpler than a second offset in the step)."""
    last = min(end, request.num_prompt_tokens - 1)
    if not request.needs_prompt_logprobs or start >= last:
        return []
    return request.prompt_token_ids[start + 1 : last + 1]


def _record_prompt_logprobs(request: Request, seq: ScheduledSeq, scored: list[tuple[float, Alternatives]]) -> None:
    """Append the chunk's prompt logprobs beyond those already known (prompt token
    i + 1 is scored at position i)."""
    known = len(request.prompt_logprobs)
    first = seq.start_pos + 1  # the prompt token the chunk's first row scores
    if first > known + 1:
        raise RuntimeError(f"{request.request_id}: prompt logprobs of tokens {known + 1}..{first - 1} were skipped")
    for offset, (logprob, top) in enumerate(scored[known + 1 - first :], start=known + 1):
        request.prompt_logprobs.append(TokenLogprob(request.prompt_token_ids[offset], logprob, top))


def _advance_grammar(request: Request, token_id: int) -> TokenRejected | GrammarFailed | None:
    """Take the sampled token into the request's grammar; the error that ends the request if
    the grammar refuses it (left as it was) or fails on it."""
    if request.grammar is None:
        return None
    try:
        request.grammar.advance(token_id)
    except (TokenRejected, GrammarFailed) as exc:
        log.warning("grammar refused the sampled token", request_id=request.request_id, error=str(exc))
        return exc
    return None


def _take_prompt_logprobs(request: Request) -> list[TokenLogprob] | None:
    """The complete prompt logprobs, the first time they can be sent."""
    if request.sampling.prompt_logprobs is None or request.prompt_logprobs_sent:
        return None
    request.prompt_logprobs_sent = True
    return list(request.prompt_logprobs)


@dataclass(slots=True)
class _InFlight:
    plan: StepPlan
    requests: dict[str, Request]  # the requests it was planned for, by id


class _StepBudget:
    """Tokens and sequence slots left in the step being planned, and what got them."""

    def __init__(self, max_tokens: int, max_seqs: int, ahead: bool = False) -> None:
        self.tokens_left = max_tokens
        self.seqs_left = max_seqs
        self.scheduled: dict[str, tuple[Request, int]] = {}  # insertion order = plan order
        self.drafts: dict[str, list[int]] = {}  # request id -> the drafts its decode carries
        self.draft_masks: dict[str, NDArray[np.int32]] = {}  # request id -> its drafting row's position_masks
        self.ahead = ahead  # planned while a step is in flight: no preemption
        self.deferred = False  # ahead, and something did not fit

    def has_room(self) -> bool:
        return self.tokens_left > 0 and self.seqs_left > 0

    def add(self, request: Request, num_tokens: int) -> None:
        self.scheduled[request.request_id] = (request, num_tokens)
        self.tokens_left -= num_tokens
        self.seqs_left -= 1


class Planner:
    def __init__(self, config: PlannerConfig, kv_cache_manager: KVManager) -> None:
        """kv_cache_manager: the worker's KV memory as the KVManager protocol
        (scheduler_svc/kv/interface.py): paged blocks or contiguous slots."""
        self.config = config.validate()
        if config.block_size != kv_cache_manager.block_size:
            raise ValueError(f"block_size {config.block_size} != KV cache block size {kv_cache_manager.block_size}")
        self.kv = kv_cache_manager
        # A request longer than the whole pool (or a contiguous slot) could never be resumed alone.
        self.max_len = min(config.max_model_len, kv_cache_manager.max_request_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.requests: dict[str, Request] = {}  # live = waiting or running
        self.num_preemptions = 0
        self.resumed_tokens = 0  # tokens of preempted requests found in the prefix index on readmission
        self.recomputed_tokens = 0  # tokens of preempted requests computed again
        self._next_step_id = 0
        self._next_arrival = 0
        # Steps sent and not yet applied, oldest first (at most two: one planned ahead).
        self._in_flight: deque[_InFlight] = deque()
        self._free_after_step: list[Request] = []  # ended while in flight: blocks freed on update()
        # Request id -> in-flight steps that sample it: its last token is not known yet.
        self._pending_samples: dict[str, int] = {}
        self._pending_forks: dict[str, list[Request]] = {}  # parent id -> children waiting for its prefill
        self.drafter = Drafter(config.speculative) if config.speculative is not None else None

    # ---- queue ----------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def idle(self) -> bool:
        """No live request, no step in flight, no ended request still holding blocks
        until its step comes back: nothing left for this worker to do (draining)."""
        return not (self.waiting or self.running or self._in_flight or self._free_after_step)

    def add(self, request: Request) -> None:
        """Queue a request; raises RequestRejected (never fits / bad args) or QueueFull."""
        self._validate(request)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests waiting (max_waiting={self.config.max_waiting})")
        for child in request.children:
            self._validate(child)
        request.arrival_index = self._next_arrival
        self._next_arrival += 1
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.children:
            self._pending_forks[request.request_id] = list(request.children)
            for child in request.children:
                child.status, child.arrival_index = RequestStatus.WAITING, request.arrival_index
                self.requests[child.request_id] = child

    def abort(self, request_id: str) -> bool:
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> bool:
        """End a live request (abort, stop string). Its blocks are freed now, or by
        the update() of the step it is in flight in (whose result is then ignored)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if self._unlink_pending_child(request):
            request.status, request.finish_reason = RequestStatus.FINISHED, reason
            return True
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        # Children still waiting for this parent's prefill end with it; they hold no blocks.
        for child in self._pending_forks.pop(request_id, []):
            self.requests.pop(child.request_id, None)
            child.status, child.finish_reason = RequestStatus.FINISHED, reason
        request.status, request.finish_reason = RequestStatus.FINISHED, reason
        if self.drafter is not None:
            self.drafter.drop(request_id)
        if self._is_in_flight(request):
            self._free_after_step.append(request)
        else:
            self.kv.free(request)
        return True

    def _unlink_pending_child(self, request: Request) -> bool:
        """Drop a child still waiting for its parent's prefill; a parent left
        with no children has nothing to compute for and ends too."""
        for parent_id, children in self._pending_forks.items():
            if request in children:
                children.remove(request)
                if not children:
                    del self._pending_forks[parent_id]
                    self.finish(parent_id, FinishReason.ABORT)
                return True
        return False

    # ---- planning -------------------------------------------------------
    def schedule(self) -> StepPlan:
        """The next step. With a step in flight, planned ahead of its result (see the module doc)."""
        if len(self._in_flight) > 1:
            raise RuntimeError("two steps are in flight: update() the oldest before planning another")
        ahead = bool(self._in_flight)
        budget = _StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs, ahead)
        preempted: list[str] = []
        self._schedule_running(budget, preempted, decodes=True)
        self._schedule_running(budget, preempted, decodes=False)
        # Right after a preemption memory is tight and the queue's head is the
        # request just preempted: admitting now would only thrash.
        if not preempted:
            self._admit_waiting(budget)
        return self._build_plan(budget, preempted)

    @property
    def can_plan_ahead(self) -> bool:
        """One step is in flight and the next may be planned before its result. Not
        behind a step with drafts: its drafting requests go on drafting in the next
        step (planned ahead they would sit it out), and on a CPU a step's forward
        dwarfs what overlapping the plan saves."""
        if len(self._in_flight) != 1:
            return False
        plan = self._in_flight[0].plan
        return not plan.deferred and not any(seq.num_drafts for seq in plan.seqs)

    def _schedule_running(self, budget: _StepBudget, preempted: list[str], decodes: bool) -> None:
        """Decodes (one token left) of running requests, or else their next prefill chunks; oldest first."""
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.request_id in budget.scheduled:
                continue  # preempted earlier in this loop, or already has its tokens
            # < 0: its drafts are in flight, so its next input is not known yet.
            remaining = self._known_end(request) - request.num_computed_tokens
            if remaining <= 0 or (remaining == 1) != decodes or self._ends_in_flight(request):
                continue
            if decodes and budget.ahead and self._waits_to_draft(request):
                continue
            if budget.ahead and not self.config.constrained_ahead and self._waits_for_its_grammar(request):
                continue
            if not budget.has_room():
                return
            want = min(remaining, self._chunk_limit(), budget.tokens_left)
            granted = self._reserve_drafts(request, budget) if decodes else 0
            granted = granted or self._reserve_slots(request, want, budget, preempted)
            if granted:
                budget.add(request, granted)

    def _known_end(self, request: Request) -> int:
        """Tokens of the request once the steps in flight are applied: its own, plus
        one per in-flight step that samples it."""
        return request.num_tokens + self._pending_samples.get(request.request_id, 0)

    def _waits_for_its_grammar(self, request: Request) -> bool:
        """Its next token's mask needs the token the step in flight samples."""
        return request.grammar is not None and self._pending_samples.get(request.request_id, 0) > 0

    def _ends_in_flight(self, request: Request) -> bool:
        """The token sampled in flight will reach max_tokens or the length limit:
        planning past it would only be discarded."""
        pending = self._pending_samples.get(request.request_id, 0)
        return pending > 0 and (
            request.num_output_tokens + pending >= request.sampling.max_tokens
            or request.num_tokens + pending >= self.max_len
        )

    def _waits_to_draft(self, request: Request) -> bool:
        """Its token is in flight, and it would rather wait for it and draft than be
        planned ahead of it (speculation.py's back-off says when)."""
        return (
            self.drafter is not None
            and request.request_id in self._pending_samples
            and self.drafter.on_for(len(self.running))
            and self.drafter.waits_to_draft(request)
        )

    def _reserve_drafts(self, request: Request, budget: _StepBudget) -> int:
        """Slots for a decode and its drafts, when the request drafts and they fit
        without preempting anyone; 0: it decodes plainly (its last token is in
        flight, it proposes nothing, or the slots are not there)."""
        if self.drafter is None or not self.drafter.on_for(len(self.running)):
            return 0
        if request.request_id in self._pending_samples:
            self.drafter.planned_ahead(request.request_id)
            return 0
        drafts, masks = self.drafter.drafts(request, self.max_len, budget.tokens_left), None
        if drafts and request.grammar is not None:
            drafts, masks = self.drafter.under_grammar(request, drafts)
        if not drafts or self.kv.allocate_slots(request, 1 + len(drafts)) is None:
            return 0
        budget.drafts[request.request_id] = drafts
        if masks is not None:
            budget.draft_masks[request.request_id] = masks
        return 1 + len(drafts)

    def _reserve_slots(self, request: Request, want: int, budget: _StepBudget, preempted: list[str]) -> int:
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
            victim = self._victim(budget)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return 0

    def _admit_waiting(self, budget: _StepBudget) -> None:
        """FIFO admission; stops at the first request whose chunk does not fit,
        so a big request at the head is not starved by smaller ones behind it."""
        while self.waiting and budget.has_room() and len(self.running) < self.config.max_num_seqs:
            request = self._next_waiting()
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            want = min(request.num_tokens - num_hit_tokens, self._chunk_limit(), budget.tokens_left)
            if self.kv.allocate_slots(request, want, hits) is None:
                budget.deferred = budget.deferred or budget.ahead
                return
            self.waiting.remove(request)
            request.num_computed_tokens = num_hit_tokens
            if request.num_preemptions == 0:
                request.num_cached_prompt_tokens = num_hit_tokens
                self.kv.record_prefix_lookup(request, num_hit_tokens)
            else:
                # A resumed request: its committed blocks come back from the index;
                # only the rest is computed again.
                self.resumed_tokens += num_hit_tokens
                self.recomputed_tokens += request.num_tokens - num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget.add(request, want)

    def _chunk_limit(self) -> int:
        return self.config.chunk_limit(self.kv.free_fraction)

    # ---- the scheduling policy: who goes first, who gives way ---------------
    def _next_waiting(self) -> Request:
        """The waiting request admitted next: the queue's head (fcfs: arrival order, a
        preempted request back at the front), or the most urgent (priority: lowest value,
        then earliest arrival)."""
        if self.config.scheduling_policy == "priority":
            return min(self.waiting, key=_urgency)
        return self.waiting[0]

    def _victim(self, budget: _StepBudget) -> Request:
        """The running request to preempt, among those not yet scheduled this step: the
        newest (fcfs), or the least urgent (priority: highest value, then latest arrival)."""
        candidates = [r for r in self.running if r.request_id not in budget.scheduled]
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=_urgency)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        """Release all blocks and requeue at the front. Outputs are kept: on resume
        prompt + outputs are recomputed, mostly as prefix-cache hits."""
        self.kv.free(request)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        log.info(
            "request_preempted",
            request_id=request.request_id,
            num_tokens=request.num_tokens,
            free_blocks=self.kv.usage().free_blocks,
            total_preemptions=self.num_preemptions,
        )

    def _build_plan(self, budget: _StepBudget, preempted: list[str]) -> StepPlan:
        # A plan made ahead runs on the worker only right after the step in flight
        # (and its decodes take their input from that step's samples).
        previous = self._in_flight[-1].plan.step_id if budget.ahead else None
        plan = StepPlan(
            step_id=self._next_step_id,
            preempted=preempted,
            copies=self.kv.take_copies(),
            previous_step_id=previous,
            deferred=budget.deferred,
        )
        self._next_step_id += 1
        for request, num_tokens in budget.scheduled.values():
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            from_previous = start == request.num_tokens  # its input is sampled by the step in flight
            drafts = budget.drafts.get(request.request_id, [])
            sample = (end == self._known_end(request) or bool(drafts)) and not request.prefill_only
            sample = sample and request.sampling.max_tokens > 0
            scheduled = ScheduledSeq(
                request_id=request.request_id,
                seq_id=request.seq_id,
                token_ids=[0] if from_previous else request.all_token_ids[start:end] + drafts,
                start_pos=start,
                block_table=self.kv.block_table(request.request_id),
                slot_mapping=self.kv.slot_mapping(request, start, end),
                sample=sample,
                sampling=request.sampling,
                token_from_previous_step=from_previous,
                prompt_logprob_targets=_prompt_logprob_targets(request, start, end),
                num_drafts=len(drafts),
            )
            if sample:
                self._add_sample_inputs(scheduled, request)
                scheduled.grammar = request.grammar
                scheduled.mask_follows = request.grammar is not None and from_previous
                scheduled.position_masks = budget.draft_masks.get(request.request_id)
            plan.seqs.append(scheduled)
            request.num_computed_tokens = end
            if sample:
                self._pending_samples[request.request_id] = self._pending_samples.get(request.request_id, 0) + 1
            if not request.output_token_ids:
                plan.prefill_progress.append(PrefillProgress(request.request_id, end, _prompt_total(request)))
        if plan.seqs:
            self._in_flight.append(_InFlight(plan, {r.request_id: r for r, _ in budget.scheduled.values()}))
        return plan

    def _add_sample_inputs(self, seq: ScheduledSeq, request: Request) -> None:
        """What the worker needs beyond the options to sample this request's next token
        (before this plan counts it as pending): the ids min_tokens still blocks, and
        the tokens the penalties look at."""
        s = request.sampling
        generated = request.num_output_tokens + self._pending_samples.get(request.request_id, 0)
        if generated < s.min_tokens:
            stops = set(s.stop_token_ids) | (set() if s.ignore_eos else set(request.eos_token_ids))
            seq.blocked_token_ids = tuple(sorted(stops))
        if s.has_penalties:
            seq.penalty_output_ids = tuple(request.output_token_ids)
            if s.repetition_penalty != 1.0:
                seq.penalty_prompt_ids = request.distinct_prompt_ids

    def _is_in_flight(self, request: Request) -> bool:
        return any(step.requests.get(request.request_id) is request for step in self._in_flight)

    # ---- results --------------------------------------------------------
    def update(self, plan: StepPlan, samples: StepSamples) -> list[RequestUpdate]:
        """Apply a step's results; one RequestUpdate per scheduled request still live.
        `samples` holds a row for each sampling sequence of the plan, and the
        alternatives and prompt logprobs the plan asked for.

        Finished requests are retired and their blocks freed here, so the next
        schedule() can hand those blocks to new requests.
        """
        if not plan.seqs:
            return []  # an empty plan was never in flight
        if not self._in_flight or plan is not self._in_flight[0].plan:
            raise RuntimeError(f"update() got step {plan.step_id}, which is not the oldest step in flight")
        requests = self._in_flight[0].requests
        live = [(requests[s.request_id], s) for s in plan.seqs]
        live = [(r, s) for r, s in live if r.status is RequestStatus.RUNNING]
        rows = samples.rows
        if missing := [s.seq_id for _, s in live if s.sample and s.seq_id not in rows]:
            raise ValueError(f"step {plan.step_id}: no sampled token for seq_ids {missing}")
        if missing := [s.seq_id for _, s in live if s.prompt_logprob_targets and s.seq_id not in samples.prompt]:
            raise ValueError(f"step {plan.step_id}: no prompt logprobs for seq_ids {missing}")
        self._in_flight.popleft()
        for seq in plan.seqs:
            if seq.sample:
                self._drop_pending_sample(seq.request_id)
        updates: list[RequestUpdate] = []
        for request, seq in live:
            if seq.num_drafts:
                updates += self._apply_verified(request, seq, samples)
            else:
                updates.append(self._apply(request, seq, samples))
        self._free_ended_in_flight()
        return updates

    def _drop_pending_sample(self, request_id: str) -> None:
        left = self._pending_samples.pop(request_id, 0) - 1
        if left > 0:
            self._pending_samples[request_id] = left

    def _apply(self, request: Request, seq: ScheduledSeq, samples: StepSamples) -> RequestUpdate:
        computed = seq.start_pos + len(seq.token_ids)  # this step's KV is written; later steps' may not be
        self.kv.cache_full_blocks(request, computed)
        if seq.prompt_logprob_targets:
            _record_prompt_logprobs(request, seq, samples.prompt[seq.seq_id])
        if request.prefill_only and computed == request.num_tokens:
            self._fork(request)
            return RequestUpdate(request.request_id, forked=True)
        if not seq.sample:
            progress = None
            if not request.output_token_ids:
                progress = (computed, _prompt_total(request))
            if request.sampling.max_tokens == 0 and computed == request.num_tokens:  # scored the prompt only
                self.finish(request.request_id, FinishReason.LENGTH)
                return RequestUpdate(
                    request.request_id,
                    prefill_progress=progress,
                    prompt_logprobs=_take_prompt_logprobs(request),
                    finished=True,
                    finish_reason=FinishReason.LENGTH,
                )
            return RequestUpdate(request.request_id, prefill_progress=progress)
        row = samples.rows[seq.seq_id]
        token_id, logprob = samples.token_ids[row], samples.logprobs[row]
        if (error := _advance_grammar(request, token_id)) is not None:
            return self._end_on_grammar_error(request, error)
        # The first token also closes the prompt's progress: (total, total).
        progress = None if request.output_token_ids else (request.num_prompt_tokens, request.num_prompt_tokens)
        request.append_output(token_id, logprob)
        reason = self._stop_reason(request, token_id)
        if reason is not None:
            self.finish(request.request_id, reason)
        top = samples.top.get(seq.seq_id, ()) if request.sampling.logprobs is not None else None
        return RequestUpdate(
            request.request_id,
            token_id=token_id,
            logprob=logprob,
            top_logprobs=top,
            prompt_logprobs=_take_prompt_logprobs(request),
            prefill_progress=progress,
            finished=reason is not None,
            finish_reason=reason,
        )

    def _end_on_grammar_error(self, request: Request, error: Exception) -> RequestUpdate:
        """The grammar refused or failed on a sampled token: the request ends, aborted."""
        self.finish(request.request_id, FinishReason.ABORT)
        return RequestUpdate(request.request_id, finished=True, finish_reason=FinishReason.ABORT, error=error)

    def _apply_verified(self, request: Request, seq: ScheduledSeq, samples: StepSamples) -> list[RequestUpdate]:
        """A decode that carried drafts: its accepted drafts, then the worker's token
        after them, one update each, up to the first that ends the request; the
        slots past the computed tokens (rejected drafts) are released first."""
        assert self.drafter is not None, "a plan with drafts from a planner that does not draft"
        row = samples.rows[seq.seq_id]
        accepted, draft_logprobs = samples.accepted(row)
        if not 0 <= accepted <= seq.num_drafts or len(draft_logprobs) != accepted:
            raise ValueError(f"seq_id {seq.seq_id}: {accepted} drafts accepted of {seq.num_drafts}")
        self.drafter.record(request.request_id, seq.num_drafts, accepted)
        computed = seq.start_pos + 1 + accepted  # the input and the accepted drafts have their K/V
        request.num_computed_tokens = computed
        self.kv.trim(request, computed)
        run = [*zip(seq.token_ids[1 : 1 + accepted], draft_logprobs), (samples.token_ids[row], samples.logprobs[row])]
        updates: list[RequestUpdate] = []
        reason: FinishReason | None = None
        for token_id, logprob in run:
            if (error := _advance_grammar(request, token_id)) is not None:  # the run's tokens before it stand
                return [*updates, self._end_on_grammar_error(request, error)]
            request.append_output(token_id, logprob)
            reason = self._stop_reason(request, token_id)
            updates.append(
                RequestUpdate(
                    request.request_id,
                    token_id=token_id,
                    logprob=logprob,
                    finished=reason is not None,
                    finish_reason=reason,
                    num_output_tokens=request.num_output_tokens,
                )
            )
            if reason is not None:
                break
        self.kv.cache_full_blocks(request, min(computed, request.num_tokens))
        if reason is not None:
            self.finish(request.request_id, reason)
        return updates

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is computed: its children take over its blocks
        (shared, ref +1 each) and run; the parent then lets go of its refs."""
        for child in self._pending_forks.pop(parent.request_id, []):
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        self.finish(parent.request_id, FinishReason.STOP)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        s = request.sampling
        if token_id in s.stop_token_ids or (token_id in request.eos_token_ids and not s.ignore_eos):
            return FinishReason.STOP
        if request.grammar is not None and request.grammar.is_complete:
            return FinishReason.STOP  # only EOS could follow: end now rather than sample it
        if request.num_output_tokens >= request.sampling.max_tokens or request.num_tokens >= self.max_len:
            return FinishReason.LENGTH
        return None

    def _free_ended_in_flight(self) -> None:
        """Free the ended requests that no step in flight holds any more."""
        still = [r for r in self._free_after_step if self._is_in_flight(r)]
        for request in self._free_after_step:
            if request not in still:
                self.kv.free(request)
        self._free_after_step = still

    # ---- recovery and checks --------------------------------------------
    def requeue_all(self, reset_prefix_cache: bool = True) -> None:
        """The worker's cache cannot be trusted (a step was lost, it restarted):
        drop the step in flight, send every running request back to the front of
        the queue (oldest first) and, by default, forget all cached blocks."""
        self._in_flight.clear()
        self._pending_samples.clear()
        self._free_ended_in_flight()
        for request in reversed(self.running):
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        self.running.clear()
        if reset_prefix_cache:
            self.kv.reset_prefix_cache()

    def drain(self) -> list[Request]:
        """requeue_all(), then hand every live request over (oldest running first,
        then the waiting queue), e.g. to re-add them to another worker's planner."""
        self.requeue_all(reset_prefix_cache=True)
        drained = list(self.waiting)
        if self.drafter is not None:
            for request in drained:
                self.drafter.drop(request.request_id)
        self.waiting.clear()
        self.requests.clear()
        self._pending_forks.clear()  # the drained parents carry their children along
        return drained

    def audit(self) -> None:
        """KV bookkeeping (KVCacheManager.audit) plus: waiting requests hold no
        blocks; running ones hold exactly the blocks their computed tokens need."""
        ended = [r.request_id for r in self._free_after_step]
        self.kv.audit(live_request_ids=[r.request_id for r in self.running] + ended)
        problems = [f"waiting {r.request_id} holds blocks" for r in self.waiting if self.kv.block_table(r.request_id)]
        for request in self.running:
            have = len(self.kv.block_table(request.request_id))
            if have != math.ceil(request.num_computed_tokens / self.kv.block_size):
                problems.append(f"running {request.request_id}: {have} blocks for {request.num_computed_tokens} tokens")
        if problems:
            raise LeakError("planner audit failed:\n  " + "\n  ".join(problems))

    def _validate(self, request: Request) -> None:
        check_priority(request.priority, self.config.scheduling_policy)
        if request.request_id in self.requests or request.request_id in (r.request_id for r in self._free_after_step):
            raise RequestRejected("request_id", f"{request.request_id!r} is already in use")
        check_prompt_ids(request.prompt_token_ids, vocab_size=None)
        capacity, blocks, size = self.kv.max_request_tokens, self.kv.pool.num_blocks, self.kv.block_size
        layout = f"{blocks} blocks x {size}" if capacity == blocks * size else f"one slot of {size} per request"
        check_prompt_fits(request.num_prompt_tokens, self.config.max_model_len, capacity, layout)
        check_sampling(request.sampling)
        if request.grammar is not None:
            check_constrained(request.sampling)
