"""Speculative decoding, the planner's half: which decodes carry drafts and how
many, and what an accepted run becomes (docs/design.md, speculative decoding).

The drafts come from the n-gram proposer (scheduler_svc/speculative/ngram.py);
the worker verifies them by sampling every position as one-token decoding would
(worker_svc/sampling/verify.py: greedy rows take the argmax, sampled rows the
rejection rule through the seeded Gumbel race) and answers how many it accepted.
A row drafts unless something per position is out of the worker's reach:
logprobs or prompt logprobs; or it opted out. A constrained row (structured
outputs) drafts under its grammar: its drafts stop before the first one the
grammar forbids (never accepted), and it carries the mask of every verified
position, walked through the drafts at plan time (constrained_drafts). Its
penalties count the drafts before each position on the worker; min_tokens blocks
the stop ids at every position of a decode or at none, so drafts stop short of
the position where it is reached (min_tokens_cap).

Overlapped scheduling plans a decode ahead of the token it follows, which
leaves nothing to look up, so a request that drafts is not planned ahead: it
waits for its token and drafts in the plan after, and no step is planned ahead
of a step with drafts (Planner.can_plan_ahead). Waiting costs the request a
step when others keep the worker busy, worth it only while its drafts get
accepted: a request whose lookup finds nothing, or whose drafts all get
rejected, backs off and is planned ahead as usual for a while (2 decodes,
doubling up to 32 while it keeps missing) before it waits to draft again.
And with more requests running than --speculative-disable-by-batch-size, nobody
drafts: the overlap every row keeps is worth more than the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from scheduler_svc.request import Request
from scheduler_svc.speculative.ngram import NgramConfig, NgramProposer
from scheduler_svc.structured.errors import GrammarFailed

if TYPE_CHECKING:
    from scheduler_svc.structured.matcher import GrammarMatcher


@dataclass(slots=True)
class SpecCounters:
    """Totals since start (vLLM's spec_decode counters)."""

    drafts: int = 0  # rows that carried drafts (vllm:spec_decode_num_drafts)
    draft_tokens: int = 0  # tokens drafted (vllm:spec_decode_num_draft_tokens)
    accepted_tokens: int = 0  # of those, accepted (vllm:spec_decode_num_accepted_tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafting row emitted per step: accepted drafts plus the bonus."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0


def can_draft(request: Request) -> bool:
    """The worker verifies this request's drafts as one-token decoding would sample
    them: any temperature and filters, logit bias, penalties, min_tokens (see
    min_tokens_cap) and a grammar's masks (constrained_drafts); not logprobs or
    prompt logprobs still to score."""
    return not request.no_speculation and request.sampling.logprobs is None and not request.needs_prompt_logprobs


def min_tokens_cap(request: Request) -> int | None:
    """The most drafts the request's next decode may carry so that min_tokens blocks
    its stop ids at every verified position or at none (the worker applies a row's
    blocked ids at each position alike): before min_tokens, positions up to the one
    that samples output min_tokens - 1; None: no cap (min_tokens reached)."""
    left = request.sampling.min_tokens - request.num_output_tokens
    return left - 1 if left > 0 else None


def constrained_drafts(grammar: GrammarMatcher, drafts: list[int]) -> tuple[list[int], NDArray[np.int32] | None]:
    """The drafts up to the first the grammar forbids (it could never be accepted), and
    the masks of the verified chunk's positions: [kept + 1, W], row i the mask after the
    input and i drafts, as one-token decoding would compute it then (all-allowing where
    the grammar has not started: activate_after); None when no position needs one. A copy
    of the matcher walks the drafts: the request's own one sees only the tokens the
    worker emits (update() advances it), and a grammar limit hit on a draft's path (the
    walk stops there) is not the request's failure unless plain decoding meets it."""
    walker = grammar.fork()
    masks = [_mask_now(walker)]
    kept: list[int] = []
    for draft in drafts:
        if not walker.allows(draft):
            break
        try:
            walker.advance(draft)
        except GrammarFailed:
            break
        kept.append(draft)
        masks.append(_mask_now(walker))
    if all(m is None for m in masks):
        return kept, None
    every = np.full(grammar.vocab.mask_words, -1, dtype=np.int32)
    return kept, np.stack([every if m is None else m for m in masks])


def _mask_now(grammar: GrammarMatcher) -> NDArray[np.int32] | None:
    return grammar.mask() if grammar.needs_mask else None


_BACKOFF_FIRST, _BACKOFF_MAX = 2, 32


@dataclass(slots=True)
class _Backoff:
    left: int = 0  # plain decodes before the request waits to draft again
    next: int = _BACKOFF_FIRST  # the back-off after its next miss


class Drafter:
    """The planner's proposer: drafts for one decode, within what the request and
    the step leave, and who waits for its token to draft (see the module doc)."""

    def __init__(self, config: NgramConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.counters = SpecCounters()
        self._backoff: dict[str, _Backoff] = {}

    def on_for(self, num_running: int) -> bool:
        """The batch rule: drafts only while at most disable_by_batch_size requests run."""
        return num_running <= self.config.disable_by_batch_size

    def waits_to_draft(self, request: Request) -> bool:
        """Rather than be planned ahead of its token, the request waits for it and drafts."""
        backoff = self._backoff.get(request.request_id)
        return (backoff is None or backoff.left == 0) and can_draft(request)

    def planned_ahead(self, request_id: str) -> None:
        """A plain decode of the request went ahead: one fewer before it drafts again."""
        if (backoff := self._backoff.get(request_id)) is not None and backoff.left:
            backoff.left -= 1

    def _missed(self, request_id: str) -> None:
        backoff = self._backoff.setdefault(request_id, _Backoff())
        backoff.left, backoff.next = backoff.next, min(2 * backoff.next, _BACKOFF_MAX)

    def drafts(self, request: Request, max_len: int, tokens_left: int) -> list[int]:
        """Drafts for the request's next decode: none past max_tokens or the length
        limit (the decode's own token counts first), none beyond the step's budget,
        none across min_tokens."""
        limit = min(
            request.sampling.max_tokens - request.num_output_tokens - 1,
            max_len - request.num_tokens - 1,
            tokens_left - 1,
        )
        if (cap := min_tokens_cap(request)) is not None:
            limit = min(limit, cap)
        if limit <= 0 or not request.output_token_ids or not can_draft(request):
            return []
        drafts = self.proposer.propose(request.request_id, request.all_token_ids, limit)
        if not drafts:
            self._missed(request.request_id)
        return drafts

    def under_grammar(self, request: Request, drafts: list[int]) -> tuple[list[int], NDArray[np.int32] | None]:
        """A constrained request's drafts and masks (constrained_drafts); drafts its grammar
        forbids from the first are a miss, as a lookup that finds nothing."""
        assert request.grammar is not None
        kept, masks = constrained_drafts(request.grammar, drafts)
        if not kept:
            self._missed(request.request_id)
        return kept, masks

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verified row's outcome: counted; all rejected is a miss, anything accepted ends the back-off."""
        self.counters.drafts += 1
        self.counters.draft_tokens += drafted
        self.counters.accepted_tokens += accepted
        if accepted:
            self._backoff.pop(request_id, None)
        else:
            self._missed(request_id)

    def drop(self, request_id: str) -> None:
        self.proposer.drop(request_id)
        self._backoff.pop(request_id, None)
