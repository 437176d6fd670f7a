"""Applying a step's results: each sampled token appended to its request (or, for a
decode that carried drafts, the accepted run), the grammar advanced, the prompt's
logprobs recorded, and the request ended where EOS, a stop id, max_tokens, the
length limit or its grammar says so; one RequestUpdate per token for the engine."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.planning.hooks import advance_grammar
from scheduler_svc.planning.plan import (
    Alternatives,
    RequestUpdate,
    RowPooling,
    ScheduledSeq,
    StepPlan,
    StepSamples,
    prompt_total,
)
from scheduler_svc.planning.pooling import add_chunk, pooled_output
from scheduler_svc.planning.queues import RequestQueues
from scheduler_svc.planning.speculation import Drafter
from scheduler_svc.request import FinishReason, Request, TokenLogprob

Finish = Callable[[str, FinishReason], bool]


def check_samples(plan: StepPlan, live: list[tuple[Request, ScheduledSeq]], samples: StepSamples) -> None:
    """The worker answered every row the live requests of the plan asked for."""
    if missing := [s.seq_id for _, s in live if s.sample and s.seq_id not in samples.rows]:
        raise ValueError(f"step {plan.step_id}: no sampled token for seq_ids {missing}")
    if missing := [s.seq_id for _, s in live if s.prompt_logprob_targets and s.seq_id not in samples.prompt]:
        raise ValueError(f"step {plan.step_id}: no prompt logprobs for seq_ids {missing}")
    if missing := [s.seq_id for _, s in live if s.pooling and s.seq_id not in samples.pooled]:
        raise ValueError(f"step {plan.step_id}: no pooled hidden states for seq_ids {missing}")
    if missing := [s.seq_id for _, s in live if s.return_logits and s.seq_id not in samples.logits]:
        raise ValueError(f"step {plan.step_id}: no logits for seq_ids {missing}")


def _record_prompt_logprobs(request: Request, seq: ScheduledSeq, scored: list[tuple[float, Alternatives]]) -> None:
    """Append the chunk's prompt logprobs beyond those already known (prompt token
    i + 1 is scored at position i)."""
    known = len(request.prompt_logprobs)
    first = seq.start_pos + 1  # the prompt token the chunk's first row scores
    if first > known + 1:
        raise RuntimeError(f"{request.request_id}: prompt logprobs of tokens {known + 1}..{first - 1} were skipped")
    for offset, (logprob, top) in enumerate(scored[known + 1 - first :], start=known + 1):
        request.prompt_logprobs.append(TokenLogprob(request.prompt_token_ids[offset], logprob, top))


def _take_prompt_logprobs(request: Request) -> list[TokenLogprob] | None:
    """The complete prompt logprobs, the first time they can be sent."""
    if request.sampling.prompt_logprobs is None or request.prompt_logprobs_sent:
        return None
    request.prompt_logprobs_sent = True
    return list(request.prompt_logprobs)


class StepResults:
    """Applies one sequence's share of a step; ending a request goes through `finish`
    (the planner's, which frees what the request holds)."""

    def __init__(
        self, kv: KVManager, queues: RequestQueues, drafter: Drafter | None, max_len: int, finish: Finish
    ) -> None:
        self.kv = kv
        self.queues = queues
        self.drafter = drafter
        self.max_len = max_len
        self.finish = finish

    def apply(self, request: Request, seq: ScheduledSeq, samples: StepSamples) -> list[RequestUpdate]:
        if seq.num_drafts:
            return self._apply_verified(request, seq, samples)
        return [self._apply(request, seq, samples)]

    def _apply(self, request: Request, seq: ScheduledSeq, samples: StepSamples) -> RequestUpdate:
        computed = seq.start_pos + len(seq.token_ids)  # this step's KV is written; later steps' may not be
        self.kv.cache_full_blocks(request, computed)
        if seq.prompt_logprob_targets:
            _record_prompt_logprobs(request, seq, samples.prompt[seq.seq_id])
        if request.prefill_only and computed == request.num_tokens:
            self._fork(request)
            return RequestUpdate(request.request_id, forked=True)
        if request.pooling is not None:
            return self._apply_pooled(request, seq, samples, computed)
        if not seq.sample:
            progress = None
            if not request.output_token_ids:
                progress = (computed, prompt_total(request))
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
        if (error := advance_grammar(request, token_id)) is not None:
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

    def _apply_pooled(self, request: Request, seq: ScheduledSeq, samples: StepSamples, computed: int) -> RequestUpdate:
        """A pooling request's chunk: its sum added up (mean pooling), and once the
        prompt is computed the request ends with its embedding (or a classifier's
        score), freeing its blocks (the full ones stay in the prefix cache)."""
        vector = samples.pooled.get(seq.seq_id)
        if seq.pooling is RowPooling.SUM and vector is not None:
            add_chunk(request, seq.start_pos, vector)
        progress = (computed, request.num_prompt_tokens)
        if computed < request.num_tokens:
            return RequestUpdate(request.request_id, prefill_progress=progress)
        result = pooled_output(request, vector, samples.logits.get(seq.seq_id))
        self.finish(request.request_id, FinishReason.STOP)
        return RequestUpdate(
            request.request_id,
            prefill_progress=progress,
            finished=True,
            finish_reason=FinishReason.STOP,
            embedding=result,
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
            if (error := advance_grammar(request, token_id)) is not None:  # the run's tokens before it stand
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
        """The parent's prompt is computed: its children run on its blocks, and the
        parent then lets go of its refs."""
        self.queues.start_children(parent, self.kv)
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
