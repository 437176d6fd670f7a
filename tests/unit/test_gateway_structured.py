"""Structured outputs, tool calling and reasoning in the gateway, against the
fake scheduler through the official `openai` client: every constraint field
(response_format, structured_outputs, guided_*) reaches serving.v1 as its
structured_output; a constraint the scheduler refuses is a 400 naming the
request's own field; tools are rendered by the chat template, required and
named choices become the parser's grammar, and the model's text comes back as
OpenAI tool_calls (streamed as argument deltas that reassemble to the
non-streamed answer) and reasoning_content; parsers that do not match the
model's template are refused at start-up."""

from __future__ import annotations

import contextlib
import json

import grpc
import openai
import pytest

from gateway_svc.config import GatewayConfig
from gateway_svc.forced_tools import required_schema
from gateway_svc.tool_parsers import MAX_PARALLEL_CALLS, ToolSpec, tool_parser
from tests.helpers.fake_scheduler import MODEL_NAME, WAIT_S, chat_model_dir, running_gateway
from tests.helpers.tool_models import TOOL_TEMPLATE, tool_model_dir

USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
CALL_TEXT = [
    "Let me look. ",
    "<tool",
    '_call>\n{"name": "get_weather", "argu',
    'ments": {"city": "Os',
    'lo"}}\n</tool_call>',
]
THINK_TEXT = ["<thi", "nk>Oslo is", " cold.</th", "ink>It is ", "cold."]


@contextlib.contextmanager
def _gateway(fake_scheduler, model_dir, **flags):
    """The official client on a gateway over the fake scheduler."""
    with running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), **flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        yield client
        client.close()


@pytest.fixture(scope="module")
def plain(fake_scheduler, tmp_path_factory):
    with _gateway(fake_scheduler, chat_model_dir(tmp_path_factory.mktemp("models"))) as client:
        yield client


@pytest.fixture(scope="module")
def tools(fake_scheduler, tmp_path_factory):
    model_dir = tool_model_dir(tmp_path_factory.mktemp("models") / "tool-model")
    with _gateway(fake_scheduler, model_dir, tool_call_parser="hermes", enable_auto_tool_choice=True) as client:
        yield client


@pytest.fixture(scope="module")
def thinking(fake_scheduler, tmp_path_factory):
    model_dir = tool_model_dir(tmp_path_factory.mktemp("models") / "tool-model")
    with _gateway(fake_scheduler, model_dir, reasoning_parser="qwen3") as client:
        yield client


# ---- constraints -------------------------------------------------------------------------------
CONSTRAINTS = [
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}},
        {"json_schema": json.dumps(SCHEMA), "json_schema_strict": True},
    ),
    (  # OpenAI's strict defaults to false: best effort
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}},
        {"json_schema": json.dumps(SCHEMA), "json_schema_strict": False},
    ),
    ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": json.dumps(SCHEMA)}),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, {"json_schema": '{"type": "string"}'}),
    ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, {"regex": "[0-9]{3}"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"choice": ["yes", "no"]}),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, {"grammar": 'start: "a"+'}),
    ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}),
    ({"guided_regex": "[a-z]+"}, {"regex": "[a-z]+"}),
    ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
    ({"guided_grammar": "root ::= [a-z]+"}, {"grammar": "root ::= [a-z]+"}),
]


def _structured_output(req) -> dict:
    kind = req.WhichOneof("structured_output")
    found = {} if kind is None else {kind: list(req.choice.choices) if kind == "choice" else getattr(req, kind)}
    if req.HasField("json_schema_strict"):
        found["json_schema_strict"] = req.json_schema_strict
    return found


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize(
    "body, want", CONSTRAINTS, ids=[next(iter(b)) + f"-{i}" for i, (b, _) in enumerate(CONSTRAINTS)]
)
def test_each_constraint_field_reaches_serving_v1(plain, fake_scheduler, endpoint, body, want):
    if endpoint == "chat":
        plain.chat.completions.create(model=MODEL_NAME, messages=USER, n=2, extra_body=body)
    else:
        plain.completions.create(model=MODEL_NAME, prompt=["a", "b"], extra_body=body)
    assert len(fake_scheduler.requests) == 2  # every choice carries it
    for req in fake_scheduler.requests:
        assert _structured_output(req) == want
        assert not req.structured_output_after  # no reasoning parser


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "body, param",
    [
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"x": 5}}}},
         "response_format"),
    ],
)  # fmt: skip
def test_a_constraint_the_scheduler_refuses_is_a_400_naming_the_request_field(
    plain, fake_scheduler, stream, body, param
):
    fake_scheduler.abort = (grpc.StatusCode.INVALID_ARGUMENT, "structured_output.regex: invalid regex (unclosed class)")
    with pytest.raises(openai.BadRequestError) as err:
        plain.chat.completions.create(model=MODEL_NAME, messages=USER, stream=stream, extra_body=body)
    assert err.value.body["param"] == param
    assert err.value.body["message"].endswith(": invalid regex (unclosed class)")
    assert err.value.body["message"].startswith(param)


# ---- tools ---------------------------------------------------------------------------------------
def _specs(tools: list[dict]) -> list[ToolSpec]:
    return [ToolSpec(t["function"]["name"], t["function"].get("parameters") or ToolSpec("x").parameters) for t in tools]


@pytest.mark.parametrize(
    "choice, parallel, grammar",
    [
        ("auto", None, None),
        (None, None, None),  # auto, OpenAI's default with tools
        ("required", None, tool_parser("hermes").grammar(_specs(TOOLS), True)),
        ("required", False, tool_parser("hermes").grammar(_specs(TOOLS), False)),
        ({"type": "function", "function": {"name": "get_weather"}}, None,
         tool_parser("hermes").grammar(_specs(TOOLS[:1]), False)),
    ],
    ids=["auto", "unset", "required", "required-one", "named"],
)  # fmt: skip
def test_tools_are_rendered_and_forced_calls_become_the_parsers_grammar(
    tools, fake_scheduler, choice, parallel, grammar
):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    options = {} if choice is None else {"tool_choice": choice}
    tools.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS, **options, **extra)
    [req] = fake_scheduler.requests
    assert json.dumps(TOOLS[0]) in req.prompt and "<tools>" in req.prompt  # the template's rendering
    assert _structured_output(req) == ({} if grammar is None else {"grammar": grammar})


def test_tool_choice_none_renders_no_tools_and_may_constrain_the_answer(tools, fake_scheduler):
    tools.chat.completions.create(
        model="tool-model", messages=USER, tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}
    )
    [req] = fake_scheduler.requests
    assert "<tools>" not in req.prompt and _structured_output(req) == {"json_object": True}
    with pytest.raises(openai.BadRequestError) as err:  # calls and a response format cannot both be enforced
        tools.chat.completions.create(
            model="tool-model", messages=USER, tools=TOOLS, response_format={"type": "json_object"}
        )
    assert err.value.body["param"] == "response_format" and "tool_choice none" in err.value.message


def test_tool_calls_come_back_parsed_and_stream_as_argument_deltas(tools, fake_scheduler):
    fake_scheduler.deltas, fake_scheduler.finish_reason = CALL_TEXT, "stop"
    done = tools.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS)
    [choice] = done.choices
    want = tool_parser("hermes").parse("".join(CALL_TEXT))
    assert choice.finish_reason == "tool_calls" and choice.message.content == want.content == "Let me look. "
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", '{"city": "Oslo"}')
    assert call.id.startswith("call_")

    chunks = list(tools.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS, stream=True))
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert content == choice.message.content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Oslo"}')]
    assert sum(1 for c in chunks for p in c.choices[0].delta.tool_calls or [] if p.function.arguments) > 1
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])


def test_a_named_function_finishes_with_stop_as_openai_does(tools, fake_scheduler):
    fake_scheduler.deltas, fake_scheduler.finish_reason = CALL_TEXT[1:], "stop"
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = tools.chat.completions.create(model="tool-model", messages=USER, tools=TOOLS, tool_choice=named)
    assert done.choices[0].finish_reason == "stop" and done.choices[0].message.content is None
    assert done.choices[0].message.tool_calls[0].function.name == "get_weather"


# ---- reasoning -----------------------------------------------------------------------------------
def test_reasoning_comes_back_apart_and_a_constraint_starts_after_it(thinking, fake_scheduler):
    fake_scheduler.deltas = THINK_TEXT
    done = thinking.chat.completions.create(model="tool-model", messages=USER, extra_body={"guided_regex": "[a-z ]+"})
    message = done.choices[0].message
    assert (message.reasoning_content, message.content) == ("Oslo is cold.", "It is cold.")
    assert fake_scheduler.requests[-1].structured_output_after == "</think>"
    reasoning, content = "", ""
    for chunk in thinking.chat.completions.create(model="tool-model", messages=USER, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == ("Oslo is cold.", "It is cold.")
    # Thinking off: the template closes the reasoning in the prompt, so the constraint starts at once.
    thinking.chat.completions.create(
        model="tool-model",
        messages=USER,
        extra_body={"guided_regex": "[a-z ]+", "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert fake_scheduler.requests[-1].prompt.endswith("<think>\n\n</think>\n\n")
    assert fake_scheduler.requests[-1].structured_output_after == ""


@pytest.mark.parametrize("flag, value", [("tool_call_parser", "hermes"), ("reasoning_parser", "deepseek_r1")])
def test_a_parser_the_models_template_does_not_write_is_refused_at_start_up(tmp_path, flag, value):
    model_dir = chat_model_dir(tmp_path)
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} {value}: the model's chat template never"):
        GatewayConfig(model_dir=str(model_dir), **{flag: value}).validate()
    GatewayConfig(model_dir=str(tool_model_dir(tmp_path / "tool-model")), **{flag: value}).validate()


# ---- tool choice without a parser (any model) ---------------------------------------------------
@pytest.mark.parametrize(
    "choice, parallel, schema",
    [
        ("required", None, required_schema(_specs(TOOLS), True)),
        ("required", False, required_schema(_specs(TOOLS), False)),
        ({"type": "function", "function": {"name": "get_weather"}}, None, WEATHER),
    ],
    ids=["required", "required-one", "named"],
)  # fmt: skip
def test_without_a_parser_forced_calls_become_a_json_schema_of_the_calls(
    plain, fake_scheduler, choice, parallel, schema
):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    plain.chat.completions.create(model=MODEL_NAME, messages=USER, tools=TOOLS, tool_choice=choice, **extra)
    [req] = fake_scheduler.requests
    assert _structured_output(req) == {"json_schema": json.dumps(schema), "json_schema_strict": True}
    if choice == "required":
        assert schema["maxItems"] == (1 if parallel is False else MAX_PARALLEL_CALLS) and schema["minItems"] == 1


REQUIRED_TEXT = [
    '[{"name": "get_weather", "param',
    'eters": {"city": "Oslo"}}, ',
    '{"name": "get_time", "parameters": {}}]',
]


@pytest.mark.parametrize("stream", [False, True])
def test_without_a_parser_the_forced_json_comes_back_as_tool_calls(plain, fake_scheduler, stream):
    fake_scheduler.deltas, fake_scheduler.finish_reason = REQUIRED_TEXT, "stop"
    answer = _answer(plain, "required", stream)
    assert answer["finish_reason"] == "tool_calls" and answer["content"] is None
    assert answer["calls"] == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    fake_scheduler.deltas = ['{"city": ', '"Oslo"}']
    answer = _answer(plain, {"type": "function", "function": {"name": "get_weather"}}, stream)
    assert answer["finish_reason"] == "stop" and answer["calls"] == [("get_weather", '{"city": "Oslo"}')]


@pytest.mark.parametrize("parser, stream", [(False, False), (False, True), (True, False)])
def test_a_forced_call_cut_by_max_tokens_is_length_with_the_text_and_no_call(
    plain, tools, fake_scheduler, parser, stream
):
    """Never a call with truncated arguments, nor a tag leaking as half a call. (Streamed
    with a parser, calls go out piece by piece: a cut one's pieces are out already.)"""
    cut = CALL_TEXT[1:4] if parser else REQUIRED_TEXT[:2]
    fake_scheduler.deltas, fake_scheduler.finish_reason = cut, "length"
    answer = _answer(tools if parser else plain, "required", stream, "tool-model" if parser else MODEL_NAME)
    assert answer == {"finish_reason": "length", "content": "".join(cut), "calls": []}


def _answer(client, choice, stream: bool, model: str = MODEL_NAME) -> dict:
    """finish_reason, content and (name, arguments) of the calls, streamed or not."""
    options = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": choice}
    if not stream:
        [done] = client.chat.completions.create(**options).choices
        calls = [(c.function.name, c.function.arguments) for c in done.message.tool_calls or []]
        return {"finish_reason": done.finish_reason, "content": done.message.content, "calls": calls}
    content, calls, reason = None, {}, None
    for chunk in client.chat.completions.create(**options, stream=True):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        for piece in delta.tool_calls or []:
            name, arguments = calls.get(piece.index, (piece.function.name, ""))
            calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
        reason = chunk.choices[0].finish_reason or reason
    return {"finish_reason": reason, "content": content, "calls": [calls[i] for i in sorted(calls)]}


# ---- --chat-template, --chat-template-content-format ---------------------------------------------
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{% for p in m['content'] %}[{{ p.text }}]{% endfor %}\n{% endfor %}"
)


def test_chat_template_flag_replaces_the_models_as_a_file_or_text(tmp_path):
    model_dir = chat_model_dir(tmp_path)
    file = tmp_path / "tools.jinja"
    file.write_text(TOOL_TEMPLATE)
    for given in (str(file), TOOL_TEMPLATE):
        config = GatewayConfig(model_dir=str(model_dir), chat_template=given, tool_call_parser="hermes")
        config.validate()  # the parser's marker is in --chat-template's template, not the model's
        assert config.template().source == TOOL_TEMPLATE
    with pytest.raises(ValueError, match="--chat-template: 'no/such/file.jinja' is neither a file nor a Jinja"):
        GatewayConfig(model_dir=str(model_dir), chat_template="no/such/file.jinja").validate()
    with pytest.raises(ValueError, match="--chat-template: not a valid Jinja template"):
        GatewayConfig(model_dir=str(model_dir), chat_template="{% for %}").validate()
    with pytest.raises(ValueError, match="--enable-auto-tool-choice: needs a --tool-call-parser"):
        GatewayConfig(model_dir=str(model_dir), enable_auto_tool_choice=True).validate()


@pytest.mark.parametrize("content_format, want", [("auto", "user:[hi]"), ("openai", "user:[hi]"),
                                                  ("string", "user:[][]")])  # fmt: skip
def test_content_format_gives_a_template_that_loops_over_parts_its_parts(tmp_path, content_format, want):
    model_dir = chat_model_dir(tmp_path)
    config = GatewayConfig(model_dir=str(model_dir), chat_template=PARTS_TEMPLATE,
                           chat_template_content_format=content_format)  # fmt: skip
    template = config.template()
    assert template.content_format == ("openai" if content_format == "auto" else content_format)
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == want
