"""Speculative decoding, the planner's half: which decodes carry drafts and how
many, and what an accepted run becomes (docs/design.md, speculative decoding).

The drafts come from the n-gram proposer (scheduler_svc/speculative/ngram.py);
the worker verifies them greedily (worker_svc/sampling/verify.py) and answers
how many it accepted. A row drafts only where greedy verification yields
exactly the tokens plain decoding would and nothing else is asked of each
position: a greedy request with no logprobs, logit bias, penalties or blocked
ids (min_tokens still to reach), whose last token is known (nothing of it in
flight), and which has not opted out.

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

from scheduler_svc.request import Request
from scheduler_svc.speculative.ngram import NgramConfig, NgramProposer


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
    """Greedy verification gives this request exactly its plain decoding tokens."""
    s = request.sampling
    return (
        s.temperature == 0
        and not request.no_speculation
        and request.grammar is None
        and s.logprobs is None
        and not s.logit_bias
        and not s.has_penalties
        and request.num_output_tokens >= s.min_tokens
        and not request.needs_prompt_logprobs
    )


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
        limit (the decode's own token counts first), none beyond the step's budget."""
        limit = min(
            request.sampling.max_tokens - request.num_output_tokens - 1,
            max_len - request.num_tokens - 1,
            tokens_left - 1,
        )
        if limit <= 0 or not request.output_token_ids or not can_draft(request):
            return []
        drafts = self.proposer.propose(request.request_id, request.all_token_ids, limit)
        if not drafts:
            self._missed(request.request_id)
        return drafts

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
