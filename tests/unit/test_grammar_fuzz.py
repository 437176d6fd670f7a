"""Fuzzing the grammar path (issue 35, item 1; `make test-slow`): random Lark
grammars (rule chains and trees, nesting, alternations, regex terminals), JSON
schemas nested to random depths and regexes, through the service's compiler with
its sandbox, with the default bounds and with none. Every constraint either
compiles or is refused naming its field; nothing reaches this process's native
stack. GRAMMAR_FUZZ_EXAMPLES sets the examples per case (the issue's 10-minute
run: ~2,000)."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.structured import Constraint, ConstraintRejected, GrammarCompiler
from scheduler_svc.structured.limits import GrammarLimits
from scheduler_svc.structured.sandbox import CompileSandbox, SandboxVocab
from tests.helpers.deep_constraints import nested_regex, nested_schema, rule_chain
from tests.helpers.grammar_walk import TINY_EOS, tiny_vocab
from tests.helpers.schema_strategies import SCHEMAS
from tools.tiny_tokenizer import train_tokenizer_json

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GRAMMAR_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
LIMITS = {"default": GrammarLimits(), "none": GrammarLimits(max_chars=10**8, max_rules=10**8, max_depth=10**8)}

LITERAL = st.text(alphabet='abcxyz(){}[]|*+?:"\\/ \n', min_size=1, max_size=6).map(json.dumps)
TERMINAL = st.sampled_from(["/[a-z]+/", "/[0-9]{1,3}/", "/(a|b)*c/", '"z"', '/[^"]*/'])


@st.composite
def lark_grammars(draw) -> str:
    shape = draw(st.sampled_from(["chain", "tree", "nest", "junk"]))
    if shape == "chain":
        return rule_chain(draw(st.integers(0, 4000)))
    if shape == "nest":
        depth = draw(st.integers(1, 3000))
        return "start: " + "(" * depth + draw(LITERAL) + ")" * depth + draw(st.sampled_from(["", "*", "+", "?"]))
    if shape == "junk":
        return draw(st.text(min_size=1, max_size=400)) or "start"
    rules = draw(st.integers(1, 60))
    lines = ["start: r0"]
    for i in range(rules):
        refs = [f"r{j}" for j in draw(st.lists(st.integers(0, rules), max_size=3))]
        leaf = draw(st.one_of(LITERAL, TERMINAL))
        body = " | ".join([" ".join(refs) or leaf, leaf])
        lines.append(f"r{i}: {body}")
    lines.append(f"r{rules}: {draw(LITERAL)}")
    return "\n".join(lines)


@st.composite
def constraints(draw) -> Constraint | str:
    kind = draw(st.sampled_from(["grammar", "schema", "deep_schema", "regex"]))
    if kind == "grammar":
        return Constraint.grammar(draw(lark_grammars()))
    if kind == "schema":
        return Constraint.json_schema(draw(SCHEMAS))
    if kind == "deep_schema":
        return nested_schema(draw(st.integers(1, 12_000)))  # text: the parse itself is under test
    if draw(st.booleans()):
        return Constraint.regex(nested_regex(draw(st.integers(1, 3000))))
    return Constraint.regex(draw(st.text(alphabet="ab()[]{}|*+?\\.^$0-9,", min_size=1, max_size=200)))


@pytest.mark.parametrize("bounds", LIMITS)
def test_every_constraint_compiles_or_is_refused_by_name(bounds):
    sandbox = CompileSandbox(SandboxVocab(train_tokenizer_json(), 768, (TINY_EOS,)), timeout_s=20.0)
    compiler = GrammarCompiler(tiny_vocab(), timeout_s=20.0, grammar_limits=LIMITS[bounds], sandbox=sandbox)
    outcomes = {"compiled": 0, "refused": 0}

    @FUZZ
    @given(constraints())
    def check(drawn: Constraint | str) -> None:
        try:
            constraint = Constraint.json_schema(drawn) if isinstance(drawn, str) else drawn
            compiler.compile(constraint)
            outcomes["compiled"] += 1
        except ConstraintRejected as exc:
            assert exc.field.startswith("structured_output.") and exc.message
            outcomes["refused"] += 1

    try:
        check()
        # The repro, whatever was drawn, and a plain grammar afterwards.
        with pytest.raises(ConstraintRejected):
            compiler.compile(Constraint.grammar(rule_chain(3000)))
        assert compiler.compile(Constraint.grammar('start: "ok"')).new_matcher() is not None
    finally:
        compiler.close()  # and its sandbox
    assert outcomes["compiled"] > 0 and outcomes["refused"] > 0, outcomes
