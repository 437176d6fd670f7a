"""Reasoning split (gateway_svc/reasoning.py): `<think>…</think>` apart from
the answer, non-streamed and streamed in any chunking, for both conventions."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway_svc.reasoning import ReasoningDelta, ReasoningSplit, join, reasoning_parser

CASES = {
    "qwen3": [
        ("<think>\nLet me see.\n</think>\n\nParis.", ReasoningSplit("\nLet me see.\n", "\n\nParis.")),
        ("Paris.", ReasoningSplit(None, "Paris.")),  # thinking off: no tags at all
        ("  <think>a</think>b", ReasoningSplit("a", "b")),
        ("<think>cut off while thin", ReasoningSplit("cut off while thin", None)),
        ("<think></think>answer", ReasoningSplit(None, "answer")),
        ("an answer that mentions </think> late", ReasoningSplit(None, "an answer that mentions </think> late")),
        ("<thin", ReasoningSplit(None, "<thin")),
        ("", ReasoningSplit(None, None)),
    ],
    "deepseek_r1": [
        ("Let me see.\n</think>\n\nParis.", ReasoningSplit("Let me see.\n", "\n\nParis.")),
        ("<think>a</think>b", ReasoningSplit("a", "b")),
        ("all reasoning, cut off", ReasoningSplit("all reasoning, cut off", None)),
        ("x</think>", ReasoningSplit("x", None)),
        ("a < b </thinking> c", ReasoningSplit("a < b </thinking> c", None)),
    ],
}


@pytest.mark.parametrize(("name", "text", "expected"), [(n, t, e) for n, cases in CASES.items() for t, e in cases])
def test_split(name, text, expected):
    assert reasoning_parser(name).split(text) == expected


@settings(max_examples=300, deadline=None)
@given(
    case=st.sampled_from([(n, t) for n, cases in CASES.items() for t, _ in cases]),
    cuts=st.lists(st.integers(0, 1000), max_size=30),
)
def test_streamed_deltas_reassemble_to_the_split(case, cuts):
    name, text = case
    stream = reasoning_parser(name).stream()
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish()]
    assert join(deltas) == reasoning_parser(name).split(text)
    assert "</think>" not in "".join(d.reasoning for d in deltas)  # the end tag never leaks into the reasoning


def test_reasoning_streams_before_the_end_tag_arrives():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<th") == ReasoningDelta()
    assert stream.feed("ink>I wonder</th") == ReasoningDelta(reasoning="I wonder")
    assert stream.feed("ink>Yes") == ReasoningDelta(content="Yes")
    assert stream.finish() == ReasoningDelta()
    assert reasoning_parser("qwen3").end_tag == "</think>"


def test_an_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'; choose from \['deepseek_r1', 'qwen3'\]"):
        reasoning_parser("granite")
