"""The planner's hooks for speculative decoding (speculation.py's Drafter) and
structured outputs (a request's grammar): whether a decode waits rather than be
planned ahead, the slots of a decode with drafts, and a sampled token taken into
the grammar."""

from __future__ import annotations

import structlog

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.planning.budget import StepBudget
from scheduler_svc.planning.inflight import InFlight
from scheduler_svc.planning.speculation import Drafter
from scheduler_svc.request import Request
from scheduler_svc.structured.errors import GrammarFailed, TokenRejected

log = structlog.get_logger(__name__)


def waits_for_its_grammar(request: Request, in_flight: InFlight) -> bool:
    """Its next token's mask needs the token the step in flight samples."""
    return request.grammar is not None and in_flight.pending(request.request_id) > 0


def advance_grammar(request: Request, token_id: int) -> TokenRejected | GrammarFailed | None:
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


class DraftHooks:
    """Which decodes carry drafts, for a planner whose drafter may be off (None)."""

    def __init__(self, drafter: Drafter | None, kv: KVManager, in_flight: InFlight, max_len: int) -> None:
        self.drafter = drafter
        self.kv = kv
        self.in_flight = in_flight
        self.max_len = max_len

    def waits_to_draft(self, request: Request, num_running: int) -> bool:
        """Its token is in flight, and it would rather wait for it and draft than be
        planned ahead of it (speculation.py's back-off says when)."""
        return (
            self.drafter is not None
            and self.in_flight.pending(request.request_id) > 0
            and self.drafter.on_for(num_running)
            and self.drafter.waits_to_draft(request)
        )

    def reserve_drafts(self, request: Request, budget: StepBudget, num_running: int) -> int:
        """Slots for a decode and its drafts, when the request drafts and they fit
        without preempting anyone; 0: it decodes plainly (its last token is in
        flight, it proposes nothing, or the slots are not there)."""
        if self.drafter is None or not self.drafter.on_for(num_running):
            return 0
        if self.in_flight.pending(request.request_id) > 0:
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

    def drop(self, request_id: str) -> None:
        if self.drafter is not None:
            self.drafter.drop(request_id)
