"""Constrained requests (structured outputs) draft: the planner cuts their drafts
at the first one the grammar forbids and sends the mask of every verified
position; over the fake worker, which samples each position under its own mask,
they give exactly plain decoding's tokens, their matchers advanced over exactly
those tokens, the audit clean."""

from __future__ import annotations

import re

import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.planning.speculation import constrained_drafts
from scheduler_svc.speculative.ngram import NgramConfig
from scheduler_svc.structured import Constraint, GrammarCompiler, GrammarMatcher, allowed_ids
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.grammar_planner import BS, CONSTRAINTS, VOCAB, constrained, run
from tests.helpers.grammar_walk import TINY_EOS, tiny_vocab

SPEC = NgramConfig(num_speculative_tokens=4, ngram_min=1, ngram_max=3, disable_by_batch_size=64)
# Repetitive constraints, so the n-gram lookup finds drafts; the copying model makes some
# of them right and the masks make some of them forbidden.
LOOPS = [Constraint.regex(r"(ab|cd|ef-){6,20}x"), Constraint.regex(r"([a-d]{3}-[0-9]){3,9}"), *CONSTRAINTS]


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(tiny_vocab())
    yield compiler
    compiler.close()


def copying(context: list[int]) -> int:
    """Repeats the text 6 tokens back, except every 7th position."""
    n = len(context)
    return (context[n - 1] * 31 + n) % VOCAB if n % 7 == 0 else context[n - 6]


def loaded(compiler, spec: NgramConfig | None) -> tuple[Planner, FakeWorker, dict]:
    kv = KVCacheManager(BlockPool(128, BS), BS, extra_keys=("m",))
    config = PlannerConfig(max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=64, speculative=spec)
    planner = Planner(config, kv)
    requests = {}
    for i in range(10):
        request = constrained(compiler, f"r{i}", i + 1, LOOPS[i % len(LOOPS)], max_tokens=80)
        requests[request.request_id] = request
        planner.add(request)
    return planner, FakeWorker(128, BS, VOCAB, model=copying), requests


@pytest.mark.parametrize("ahead", [False, True])
def test_constrained_requests_draft_and_keep_the_tokens_of_plain_decoding(compiler, ahead):
    reference, _ = run(*loaded(compiler, None)[:2], ahead=False)
    planner, worker, requests = loaded(compiler, SPEC)
    proposed: list[list[int]] = []
    propose = planner.drafter.drafts
    planner.drafter.drafts = lambda *args: proposed.append(propose(*args)) or proposed[-1]  # type: ignore[method-assign]
    outputs, plans = run(planner, worker, ahead=ahead)
    assert outputs == reference
    for rid, request in requests.items():
        tokens = outputs[rid]
        assert request.grammar is not None and request.grammar.num_tokens == len(tokens) == request.num_output_tokens
        constraint = LOOPS[int(rid[1:]) % len(LOOPS)]
        if constraint.kind == "regex":  # ended by the grammar or by its EOS
            assert re.fullmatch(constraint.text, tiny_vocab().decode([t for t in tokens if t != TINY_EOS]))
    drafting = [s for p in plans for s in p.seqs if s.num_drafts]
    assert all(s.position_masks is not None and len(s.position_masks) == s.num_drafts + 1 for s in drafting)
    counters = planner.drafter.counters
    assert 0 < counters.accepted_tokens < counters.draft_tokens  # some accepted, some rejected
    if not ahead:  # (planned ahead, requests wait to draft less often: few drafts to cut)
        assert counters.draft_tokens < sum(map(len, proposed))  # and some cut: the grammar forbade them


def test_the_walk_cuts_at_the_first_forbidden_draft_and_leaves_the_matcher_as_it_was(compiler):
    """Through an activate_after trigger (a reasoning model's </think>): all-allowing masks
    before the grammar starts, the grammar's after; cut at the letter the regex forbids."""
    vocab = tiny_vocab()
    (digit,), (letter,), (trigger,) = vocab.encode("7"), vocab.encode("x"), vocab.encode("@")
    matcher = GrammarMatcher(compiler.compile(Constraint.regex("[0-9]+")), activate_after=[trigger])
    matcher.advance(letter)  # still thinking: anything goes
    drafts = [letter, trigger, digit, letter, digit]
    kept, masks = constrained_drafts(matcher, drafts)
    assert kept == [letter, trigger, digit] and masks is not None and masks.shape[0] == len(kept) + 1
    assert (masks[:2] == -1).all()  # before and at the trigger: the grammar has not started
    for position in (2, 3):  # the grammar's own masks: digits only
        ids = set(allowed_ids(masks[position], VOCAB).tolist())
        assert digit in ids and letter not in ids
    assert matcher.num_tokens == 1 and not matcher.active  # the request's matcher never moved
    assert constrained_drafts(matcher, [letter, letter]) == ([letter, letter], None)  # no mask needed anywhere


def test_a_grammar_limit_hit_on_a_drafts_path_keeps_the_drafts_before_it_and_the_request_intact(compiler, monkeypatch):
    """llguidance fails a matcher that hits a limit (e.g. the lexer's) while consuming a
    token; on a draft's path that must neither fail nor move the request's matcher."""
    from scheduler_svc.structured.errors import GrammarFailed

    vocab = tiny_vocab()
    (digit,) = vocab.encode("7")
    matcher = GrammarMatcher(compiler.compile(Constraint.regex("[0-9]+")))
    matcher.advance(digit)
    mask_before = matcher.mask().copy()
    real_fork = matcher.fork

    def fork_failing_at_the_third_token():
        walker = real_fork()
        advance = walker.advance

        def limited(token_id):
            if walker.num_tokens == 3:
                raise GrammarFailed("a lexer limit")
            advance(token_id)

        walker.advance = limited
        return walker

    monkeypatch.setattr(matcher, "fork", fork_failing_at_the_third_token)
    kept, masks = constrained_drafts(matcher, [digit, digit, digit, digit])
    assert kept == [digit, digit] and masks is not None and masks.shape[0] == 3
    assert matcher.num_tokens == 1 and matcher.error is None and matcher.needs_mask
    assert (matcher.mask() == mask_before).all()
