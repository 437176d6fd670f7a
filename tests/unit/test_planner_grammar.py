"""Structured outputs in the planner, against the fake worker sampling under each
row's mask: update() advances a request's grammar with exactly the tokens it
appends (never a speculative token that got discarded), a complete grammar ends
the request with `stop`, a refused token ends it with an error and frees its
blocks, and planning ahead (late masks, or constrained rows held back) gives
the outputs of strict alternation."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.planning.validation import RequestRejected
from scheduler_svc.request import FinishReason, Request
from scheduler_svc.structured import Constraint, GrammarCompiler, TokenRejected
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.grammar_planner import BS, CONSTRAINTS, SCHEMA, VOCAB, constrained, run
from tests.helpers.grammar_walk import TINY_EOS, tiny_vocab


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(tiny_vocab())
    yield compiler
    compiler.close()


def make(num_blocks: int = 64, **config) -> tuple[Planner, FakeWorker]:
    kv = KVCacheManager(BlockPool(num_blocks, BS), BS, extra_keys=("m",))
    config.setdefault("max_model_len", 4096)
    return Planner(PlannerConfig(**config), kv), FakeWorker(num_blocks, BS, VOCAB)


def batch(compiler) -> list[Request]:
    """Constrained and free requests side by side."""
    return [constrained(compiler, f"r{i}", i + 1, [*CONSTRAINTS, None][i % 4]) for i in range(12)]


def check_output(request: Request, tokens: list[int], constraint: Constraint) -> None:
    text = tiny_vocab().decode(tokens)
    assert request.finish_reason is FinishReason.STOP, (request.request_id, text)
    assert request.grammar is not None and request.grammar.num_tokens == len(tokens) == request.num_output_tokens
    assert TINY_EOS not in tokens  # a complete grammar ends the request: its EOS is never sampled
    if constraint.kind == "regex":
        assert re.fullmatch(constraint.text, text), text
    elif constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert text in constraint.choices


@pytest.mark.parametrize("constrained_ahead", [True, False], ids=["late masks", "held back"])
def test_planning_ahead_gives_the_outputs_of_strict_alternation(compiler, constrained_ahead):
    reference, _ = run(*_loaded(compiler), ahead=False)
    planner, worker = _loaded(compiler, constrained_ahead=constrained_ahead)
    requests = {r.request_id: r for r in planner.waiting}
    outputs, plans = run(planner, worker, ahead=True)
    assert outputs == reference
    for rid, request in requests.items():
        if request.grammar is not None:
            check_output(request, outputs[rid], CONSTRAINTS[int(rid[1:]) % 4])
    ahead_rows = [s for p in plans if p.previous_step_id is not None for s in p.seqs if s.token_from_previous_step]
    late = [s for s in ahead_rows if s.mask_follows]
    assert all(s.grammar is not None for s in late) and all(
        s.mask_follows == (s.grammar is not None) for s in ahead_rows
    )
    if constrained_ahead:
        assert len(late) > 20  # constrained decodes planned ahead, their masks sent late
    else:
        assert not late and len(ahead_rows) > 20  # only free requests are planned ahead


def _loaded(compiler, **config) -> tuple[Planner, FakeWorker]:
    planner, worker = make(max_num_seqs=8, max_num_batched_tokens=64, **config)
    for request in batch(compiler):
        planner.add(request)
    return planner, worker


def test_a_complete_grammar_ends_the_request_with_stop(compiler):
    planner, worker = make()
    request = constrained(compiler, "c", 1, Constraint.choice(["yes"]))
    planner.add(request)
    outputs, _ = run(planner, worker, ahead=True)
    assert tiny_vocab().decode(outputs["c"]) == "yes" and request.finish_reason is FinishReason.STOP


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error_and_frees_its_blocks(compiler):
    planner, worker = make()
    request = constrained(compiler, "c", 1, Constraint.regex("[0-9]+"))
    free = constrained(compiler, "f", 2, None, max_tokens=3)
    planner.add(request)
    planner.add(free)
    plan = planner.schedule()
    letter = tiny_vocab().encode("abc")[0]
    samples = worker.execute(plan, {1: [letter]})  # a token the mask would never allow
    updates = {u.request_id: u for u in planner.update(plan, samples)}
    assert isinstance(updates["c"].error, TokenRejected) and updates["c"].finish_reason is FinishReason.ABORT
    assert request.output_token_ids == [] and "c" not in planner.requests
    assert updates["f"].error is None and updates["f"].token_id is not None
    outputs, _ = run(planner, worker, ahead=True)
    assert len(outputs["f"]) == 2  # the other request goes on; no block left behind (run's audit)


@pytest.mark.parametrize("option,value", [("ignore_eos", True), ("min_tokens", 2)])
def test_a_constraint_refuses_what_would_keep_it_from_ending(compiler, option, value):
    planner, _ = make()
    with pytest.raises(RequestRejected) as err:
        planner.add(constrained(compiler, "c", 1, Constraint.json_object(), **{option: value}))
    assert err.value.field == option
