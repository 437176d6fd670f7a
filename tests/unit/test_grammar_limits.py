"""The grammar path cannot crash the scheduler (issue 35, item 1): constraints past
the size, rule and nesting bounds are refused by name before any compile, and a
constraint that crashes llguidance's native compiler ends a sandbox child, not
this process; the compiled-grammar cache keeps the warm path in-process."""

from __future__ import annotations

import os
import signal

import pytest

from scheduler_svc.structured import Constraint, ConstraintRejected, GrammarCompiler
from scheduler_svc.structured.limits import GrammarLimits, nesting_depth
from scheduler_svc.structured.sandbox import CompileSandbox, SandboxVocab, child_stack_bytes
from tests.helpers.deep_constraints import nested_regex, nested_schema, rule_chain, schema_levels
from tests.helpers.grammar_walk import TINY_EOS, tiny_vocab
from tools.tiny_tokenizer import train_tokenizer_json

UNBOUNDED = GrammarLimits(max_chars=10**8, max_rules=10**8, max_depth=10**8)


@pytest.fixture(scope="module")
def sandbox():
    sandbox = CompileSandbox(SandboxVocab(train_tokenizer_json(), 768, (TINY_EOS,)), timeout_s=30.0)
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def unbounded(sandbox):
    """The service's compiler with the static bounds lifted: only the sandbox stands in the way."""
    compiler = GrammarCompiler(tiny_vocab(), timeout_s=30.0, grammar_limits=UNBOUNDED, sandbox=sandbox)
    yield compiler
    compiler.close()


def _refusal(compiler: GrammarCompiler, constraint: Constraint) -> str:
    with pytest.raises(ConstraintRejected) as caught:
        compiler.compile(constraint)
    assert caught.value.field == constraint.field
    return caught.value.message


# ---- the static bounds -------------------------------------------------------------------


def test_the_repro_is_refused_by_its_rule_count_before_any_compile():
    compiler = GrammarCompiler(tiny_vocab())  # no sandbox: a compile of the repro would kill pytest
    try:
        message = _refusal(compiler, Constraint.grammar(rule_chain(3000)))
    finally:
        compiler.close()
    assert message == "3002 rules, over the limit of 1000 (--max-grammar-rules)"


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (Constraint.grammar('start: "a"\n' * 3), "3 rules, over the limit of 2 (--max-grammar-rules)"),
        (
            Constraint.grammar('root ::= "a"\nb ::= "b"\nc ::= "c"\n'),
            "3 rules, over the limit of 2 (--max-grammar-rules)",
        ),
        (
            Constraint.grammar("start: " + "(" * 9 + '"a"' + ")" * 9),
            "nested 9 levels deep, over the limit of 8 (--max-grammar-depth)",
        ),
        (Constraint.regex(nested_regex(9)), "nested 9 levels deep, over the limit of 8 (--max-grammar-depth)"),
        (Constraint.json_schema(nested_schema(4)), "nested 9 levels deep, over the limit of 8 (--max-grammar-depth)"),
        (Constraint.regex("a" * 301), "301 characters, over the limit of 300 (--max-grammar-chars)"),
        (Constraint.choice(["x" * 160, "y" * 141]), "301 characters, over the limit of 300 (--max-grammar-chars)"),
    ],
)
def test_each_bound_refuses_naming_the_limit_and_its_flag(constraint, message):
    compiler = GrammarCompiler(tiny_vocab(), grammar_limits=GrammarLimits(max_chars=300, max_rules=2, max_depth=8))
    try:
        assert _refusal(compiler, constraint) == message
    finally:
        compiler.close()


def test_bounds_count_structure_not_text():
    # Brackets in a Lark literal or a JSON string are text; escaped ones in a regex too.
    assert nesting_depth('start: "((((" ")"', '"') == 0
    assert nesting_depth('{"a":"[[[[{{"}', '"') == 1
    assert nesting_depth(r"\(\(\(a", "") == 0
    assert schema_levels(nested_schema(5)) == 5 and nesting_depth(nested_schema(5), '"') == 11
    limits = GrammarLimits(max_rules=3, max_depth=3)
    limits.check(Constraint.grammar('start: a b\na: "x" | "(("\nb: /[0-9]+/\n'))  # 3 rules, depth 1


def test_schema_nested_past_the_parser_is_refused_not_a_recursion_error():
    with pytest.raises(ConstraintRejected) as caught:
        Constraint.json_schema(nested_schema(10_000))
    assert caught.value.field == "structured_output.json_schema"
    assert caught.value.message == "nested too deeply to parse"


@pytest.mark.parametrize("choice", ["a\x01b", "\x00", "x\x7f", "\x9b"])
def test_a_choice_with_a_control_character_is_refused_up_front(choice):
    with pytest.raises(ConstraintRejected) as caught:
        Constraint.choice(["fine", choice])
    assert caught.value.field == "structured_output.choice"
    assert caught.value.message.startswith("choice 1 holds the control character")


def test_tabs_and_newlines_stay_allowed_in_choices():
    assert Constraint.choice(["a\tb", "c\nd\r"]).choices == ("a\tb", "c\nd\r")


# ---- the sandbox ---------------------------------------------------------------------------


def test_a_compiler_crash_ends_a_child_not_this_process(unbounded, sandbox):
    crashes = sandbox.crashes
    message = _refusal(unbounded, Constraint.grammar(rule_chain(3000)))
    assert message == "the grammar crashed the grammar compiler (SIGSEGV)"
    assert sandbox.crashes == crashes + 1
    # A new child takes the next constraint; this process compiles it too.
    grammar = unbounded.compile(Constraint.regex("[a-c]{2}"))
    assert grammar.new_matcher().is_accepting() is False


def test_a_schema_nested_past_llguidance_is_refused_by_the_child(unbounded):
    # 300 levels: past serde's recursion bound, which llguidance reports as an error
    message = _refusal(unbounded, Constraint.json_schema(nested_schema(300)))
    assert "recursion limit exceeded" in message


def test_a_compile_past_the_time_limit_kills_its_child():
    sandbox = CompileSandbox(SandboxVocab(train_tokenizer_json(), 768, (TINY_EOS,)), timeout_s=1e-4)
    compiler = GrammarCompiler(tiny_vocab(), timeout_s=1e-4, sandbox=sandbox)
    try:
        sandbox.wait_ready()  # its start-up is not the constraint's time
        with pytest.raises(ConstraintRejected) as caught:
            compiler.compile(Constraint.json_schema('{"type":"object","properties":{"a":{"type":"integer"}}}'))
        assert "took longer than" in caught.value.message
    finally:
        compiler.close()


def test_the_warm_path_never_reaches_the_sandbox(unbounded, sandbox):
    constraint = Constraint.regex("[0-9]{3}-[0-9]{4}")
    first = unbounded.compile(constraint)
    (child,) = sandbox._idle
    os.kill(child.proc.pid, signal.SIGSTOP)  # a sandbox that cannot answer: a hit must not ask it
    try:
        assert unbounded.compile(constraint) is first
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)


def test_the_child_has_half_this_process_s_thread_stack():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    if soft != resource.RLIM_INFINITY:
        assert child_stack_bytes() == min(soft // 2, 4 << 20)
