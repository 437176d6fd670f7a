"""Tool-call parsing (gateway_svc/tool_parsers.py): each format's non-streamed
parse, streamed deltas in OpenAI's shape that reassemble to it for any
chunking, and the grammars for `tool_choice: required` / a named function,
whose every output parses into calls of the request's tools."""

from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.structured_schemas import INVOICE, WEATHER_TOOL
from gateway_svc.tool_parsers import (
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolSpec,
    assemble,
    tool_parser,
)
from scheduler_svc.structured import Constraint, GrammarCompiler, GrammarMatcher
from tests.helpers.grammar_walk import default_vocab, random_walk


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _stream(name: str, text: str, cuts: list[int]) -> list[StreamDelta]:
    stream = tool_parser(name, _ids()).stream()
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish()]


HERMES_TEXTS = [
    # content, then two calls (the second with its arguments before its name), a '}' and '</tool_call>' in strings
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "note": "a}\\"</tool_call>"}}\n'
    '</tool_call>\n<tool_call>\n{"arguments": {"x": [1, {"y": null}]}, "name": "f2"}\n</tool_call>\n',
    "no tool call <tool_ but a tag's start",
    '<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call> and after',  # arguments JSON in a string
    "<tool_call>not json</tool_call> tail",
    '<tool_call>\n{"name": "cut", "arguments": {"a": "ab',  # max_tokens inside a call
    "",
    '  <tool_call>{"name": "ünï", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": 7}</tool_call>',
]
LLAMA_TEXTS = [
    '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
    ' {"name": "f", "parameters": {"a": [1, 2]}}',
    'Hello {"name"}',
    "<|python",
    '{"name": "f", "arguments": {"a": 1}} trailing words',
    '{"parameters": {"deep": {"x": "}"}}, "name": "late"}',
]


def test_hermes_parse():
    parsed = tool_parser("hermes", _ids()).parse(HERMES_TEXTS[0])
    assert parsed == ParsedOutput(
        "Let me look.\n",
        (
            ToolCall("call_0", "get_weather", '{"city": "Paris", "note": "a}\\"</tool_call>"}'),
            ToolCall("call_1", "f2", '{"x": [1, {"y": null}]}'),
        ),
    )

    def parse(text):
        return tool_parser("hermes", _ids()).parse(text)

    assert parse(HERMES_TEXTS[1]) == ParsedOutput(HERMES_TEXTS[1], ())
    assert parse(HERMES_TEXTS[2]) == ParsedOutput(" and after", (ToolCall("call_0", "x", '{"a": 1}'),))
    assert parse(HERMES_TEXTS[3]) == ParsedOutput(HERMES_TEXTS[3], ())  # not a call: all content
    assert parse(HERMES_TEXTS[4]) == ParsedOutput(None, (ToolCall("call_0", "cut", '{"a": "ab'),))
    assert parse("") == ParsedOutput("", ())  # content is None only beside tool calls
    both = parse(HERMES_TEXTS[6])
    assert both.content == "  " and [(c.name, c.arguments) for c in both.tool_calls] == [("ünï", "{}"), ("b", "7")]


def test_llama3_json_parse():
    def parse(text):
        return tool_parser("llama3_json", _ids()).parse(text)

    assert parse(LLAMA_TEXTS[0]) == ParsedOutput(
        None, (ToolCall("call_0", "f", '{"a": 1}'), ToolCall("call_1", "g", "{}"))
    )
    assert parse(LLAMA_TEXTS[1]).tool_calls == (ToolCall("call_0", "f", '{"a": [1, 2]}'),)
    assert parse(LLAMA_TEXTS[2]) == ParsedOutput(LLAMA_TEXTS[2], ())
    assert parse(LLAMA_TEXTS[3]) == ParsedOutput("<|python", ())
    assert parse(LLAMA_TEXTS[4]) == ParsedOutput(" trailing words", (ToolCall("call_0", "f", '{"a": 1}'),))
    assert parse(LLAMA_TEXTS[5]).tool_calls == (ToolCall("call_0", "late", '{"deep": {"x": "}"}}'),)


@settings(max_examples=200, deadline=None)
@given(
    case=st.sampled_from([("hermes", t) for t in HERMES_TEXTS] + [("llama3_json", t) for t in LLAMA_TEXTS]),
    cuts=st.lists(st.integers(0, 10_000), max_size=40),
)
def test_streamed_deltas_reassemble_to_the_parse(case, cuts):
    name, text = case
    deltas = _stream(name, text, cuts)
    assert assemble(deltas) == tool_parser(name, _ids()).parse(text)
    # OpenAI's shape: a call's first delta carries its id and name, later ones only arguments.
    seen: set[int] = set()
    for delta in deltas:
        for call in delta.tool_calls:
            if call.index not in seen:
                assert call.id == f"call_{call.index}" and call.name and call.index == len(seen)
                seen.add(call.index)
            else:
                assert call.id is None and call.name is None and call.arguments


def test_the_name_streams_before_the_arguments_and_arguments_as_they_come():
    stream = tool_parser("hermes", _ids()).stream()
    assert stream.feed("<tool_call>\n{") == StreamDelta()
    assert stream.feed('"name": "get_weath') == StreamDelta()
    first = stream.feed('er", "arguments": {"ci')
    assert first == StreamDelta(tool_calls=(ToolCallDelta(0, "call_0", "get_weather", '{"ci'),))
    assert stream.feed('ty": "Oslo"}}\n</tool') == StreamDelta(tool_calls=(ToolCallDelta(0, arguments='ty": "Oslo"}'),))
    assert stream.feed("_call>") == StreamDelta() and stream.finish() == StreamDelta()


def test_an_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(
        ValueError, match=r"unknown tool-call parser 'mistral'; choose from \['hermes', 'llama3_json'\]"
    ):
        tool_parser("mistral")


# ---- grammars: tool_choice required / named -------------------------------------

TOOLS = [
    ToolSpec("get_weather", WEATHER_TOOL),
    ToolSpec("make_invoice", INVOICE),
    ToolSpec("no_arguments"),
]


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(default_vocab())
    yield compiler
    compiler.close()


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
@pytest.mark.parametrize(("tools", "parallel"), [(TOOLS, True), (TOOLS[:1], False), (TOOLS[2:], False)])
def test_a_tool_call_grammar_always_gives_calls_that_parse(compiler, name, tools, parallel):
    parser = tool_parser(name, _ids())
    grammar = compiler.compile(Constraint.grammar(parser.grammar(tools, parallel=parallel)))
    schemas = {tool.name: tool.parameters for tool in tools}
    counts = set()
    for seed in range(4):
        walk = random_walk(GrammarMatcher(grammar), random.Random(seed))
        parsed = parser.parse(walk.text)
        assert parsed.content is None and parsed.tool_calls, walk.text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        counts.add(len(parsed.tool_calls))
    assert not parallel or max(counts) >= 2, counts  # parallel calls do occur
