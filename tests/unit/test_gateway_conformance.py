"""The gateway answers as OpenAI and vLLM do, through the official `openai` client
(and raw HTTP where the client cannot send the case): 404 model_not_found for
another model, every field honoured or refused with a 400 naming it, tool calls
in the history passed to the chat template, OpenAI's error shape on every error
(invalid JSON, 404, 405), values beyond serving.v1's ranges refused at the edge
(never a 500), and a published OpenAPI document that says so."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.fake_scheduler import (
    MODEL_NAME,
    WAIT_S,
    assert_openai_error,
    chat_model_dir,
    running_gateway,
)

USER = [{"role": "user", "content": "hi"}]
# Renders tool calls (arguments as an object), tool results and a template variable.
TOOL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }}{{ c['function']['arguments'] | tojson }}"
    " id={{ c['id'] }};{% endfor %}"
    "{% if m.get('tool_call_id') %}[result of {{ m['tool_call_id'] }}]{% endif %}{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}{% if enable_thinking %}<think>{% endif %}"
)


@pytest.fixture(scope="module")
def gateway(fake_scheduler, tmp_path_factory):
    model_dir = chat_model_dir(tmp_path_factory.mktemp("models"))
    with running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir)) as url:
        yield url


@pytest.fixture(scope="module")
def tool_gateway(fake_scheduler, tmp_path_factory):
    model_dir: Path = tmp_path_factory.mktemp("models") / "tool-model"
    model_dir.mkdir()
    (model_dir / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    with running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir)) as url:
        yield url


@pytest.fixture
def oai(gateway):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
    yield client
    client.close()


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway, timeout=WAIT_S) as client:
        yield client


# ---- the model ---------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_another_model_is_404_model_not_found(oai, fake_scheduler, stream):
    with pytest.raises(openai.NotFoundError) as err:
        oai.completions.create(model="gpt-4o", prompt="x", stream=stream)
    assert err.value.code == "model_not_found" and err.value.body["param"] == "model"
    assert "gpt-4o" in err.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=USER, stream=stream)
    assert not fake_scheduler.requests
    # The served id, or none at all, is answered.
    assert oai.completions.create(model=MODEL_NAME, prompt="x").choices[0].text == "Hello, world"


def test_models_retrieve(oai):
    card = oai.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as err:
        oai.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


# ---- every field honoured or refused -----------------------------------------------------
REFUSED_CHAT = [
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("function_call", {"function_call": "auto"}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    (
        "tools",
        {"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
    ),
    ("tools.0.type", {"tools": [{"type": "retrieval"}]}),
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("response_format.type", {"response_format": {"type": "xml"}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["b"]}}),
    ("structured_outputs", {"structured_outputs": {}}),
    ("structured_outputs.structural_tag", {"structured_outputs": {"structural_tag": "{}"}}),
    ("structured_outputs", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
    ("guided_regex", {"guided_json": {}, "guided_regex": "[0-9]+"}),
    ("guided_choice", {"guided_choice": []}),
    ("guided_decoding_backend", {"guided_decoding_backend": "xgrammar"}),
    ("guided_whitespace_pattern", {"guided_whitespace_pattern": " "}),
    ("echo", {"echo": True}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("prediction", {"prediction": {"type": "content", "content": "x"}}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("store", {"store": True}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"messages": []}}),
    ("continue_final_message", {"continue_final_message": True}),  # with add_generation_prompt (the default)
    ("no_such_field", {"no_such_field": 1}),
]


@pytest.mark.parametrize("param, fields", REFUSED_CHAT, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REFUSED_CHAT)])
def test_chat_fields_we_cannot_honour_are_a_400_naming_them(oai, fake_scheduler, param, fields):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL_NAME, messages=USER, extra_body=fields)
    assert err.value.body["param"] == param, err.value.body
    assert param in err.value.message
    assert not fake_scheduler.requests


@pytest.mark.parametrize(
    "param, fields",
    [
        ("suffix", {"suffix": "x"}),
        ("guided_decoding_backend", {"guided_decoding_backend": "outlines"}),
        ("structured_outputs", {"structured_outputs": {"json": {}, "regex": "a"}}),
        ("prompt_logprobs", {"prompt_logprobs": 1}),
    ],
)
def test_completion_fields_we_cannot_honour_are_a_400_naming_them(oai, fake_scheduler, param, fields):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL_NAME, prompt="x", extra_body=fields)
    assert err.value.body["param"] == param
    assert not fake_scheduler.requests


def test_fields_honoured_at_their_values(oai, fake_scheduler):
    oai.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        user="u-1",
        tool_choice="none",
        response_format={"type": "text"},
        extra_body={"min_p": 0, "top_k": -1, "cache_salt": "tenant-a", "modalities": ["text"]},
    )
    [req] = fake_scheduler.requests
    assert not req.HasField("top_k")  # -1: off, as in vLLM (serving.v1's 0)
    assert req.cache_salt == "tenant-a"
    assert not req.HasField("max_tokens")  # a chat answer may run up to the context
    assert req.min_p == 0


def test_min_p_reaches_the_scheduler_and_out_of_range_is_a_400(oai, fake_scheduler):
    """min_p (vLLM's) is honoured now that the worker filters by it (issue 28)."""
    oai.completions.create(model=MODEL_NAME, prompt="x", temperature=1.0, extra_body={"min_p": 0.25})
    [req] = fake_scheduler.requests
    assert req.min_p == 0.25
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=MODEL_NAME, prompt="x", extra_body={"min_p": 1.5})
    assert err.value.body["param"] == "min_p"
    assert len(fake_scheduler.requests) == 1


# ---- the chat template -----------------------------------------------------------------------
def test_tool_calls_and_tool_results_reach_the_template(tool_gateway, fake_scheduler):
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "7 C"},
    ]
    client = openai.OpenAI(base_url=f"{tool_gateway}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
    try:
        client.chat.completions.create(model="tool-model", messages=messages)
        [req] = fake_scheduler.requests
        assert req.prompt == (
            "<|user|>weather?\n"
            '<|assistant|>CALL get_weather{"city": "Oslo"} id=call_1;\n'
            "<|tool|>[result of call_1]7 C\n"
            "<|assistant|>"
        )
        bad = [
            *messages[:1],
            {
                **messages[1],
                "tool_calls": [{**messages[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{oops"}}],
            },
        ]
        with pytest.raises(openai.BadRequestError, match="not JSON"):
            client.chat.completions.create(model="tool-model", messages=bad)
        with pytest.raises(openai.BadRequestError, match="tool_call_id"):
            client.chat.completions.create(model="tool-model", messages=[{"role": "tool", "content": "x"}])
    finally:
        client.close()


def test_chat_template_kwargs_and_how_the_prompt_ends(tool_gateway, fake_scheduler):
    with httpx.Client(base_url=tool_gateway, timeout=WAIT_S) as http:
        chat = {"model": "tool-model", "messages": USER}
        for extra in (
            {"chat_template_kwargs": {"enable_thinking": True}},
            {"add_generation_prompt": False},
            {
                "messages": [*USER, {"role": "assistant", "content": "Once upon"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
        ):
            r = http.post("/v1/chat/completions", json={**chat, **extra})
            assert r.status_code == 200, r.text
    prompts = [req.prompt for req in fake_scheduler.requests]
    assert prompts == ["<|user|>hi\n<|assistant|><think>", "<|user|>hi\n", "<|user|>hi\n<|assistant|>Once upon"]


# ---- errors in OpenAI's shape --------------------------------------------------------------
def test_invalid_json_says_what_and_where(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x",\n "n": }', headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400)
    assert error["message"] == (
        "the request body is not valid JSON: Expecting value at line 2, column 7 (character 22)"
    ), error


def test_unknown_route_and_wrong_method_are_openai_errors(http):
    error = assert_openai_error(http.get("/v1/nope"), 404)
    assert "/v1/nope" in error["message"]
    error = assert_openai_error(http.get("/v1/completions"), 405)
    assert "GET /v1/completions" in error["message"]
    error = assert_openai_error(http.get("/v1/models/gpt-4o"), 404)
    assert error["code"] == "model_not_found"


# ---- serving.v1's ranges, checked at the edge (what a fuzzer found as 500s) -----------------
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"min_tokens": 2**31}, "min_tokens"),
        ({"logit_bias": {"99999999999": 1}}, "logit_bias"),
        ({"logit_bias": {"²": 1}}, "logit_bias"),
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids.0"),
        ({"stop": "\ud800"}, "stop"),
        ({"cache_salt": "\ud800"}, "cache_salt"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_values_serving_v1_cannot_carry_are_a_400(http, fake_scheduler, fields, param, path):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": USER}
    error = assert_openai_error(post_json(http, path, {**body, "max_tokens": 2, **fields}), 400)
    assert error["param"] == param, error
    assert not fake_scheduler.requests


def post_json(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    """JSON with \\u escapes (httpx's own encoding cannot carry a lone surrogate)."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_text_that_is_not_utf8_is_a_400(http, fake_scheduler):
    assert_openai_error(post_json(http, "/v1/completions", {"prompt": "\ud800"}), 400)
    error = assert_openai_error(
        post_json(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udfff"}]}), 400
    )
    assert error["param"] == "messages.0.content"
    assert not fake_scheduler.requests


# ---- the published schema --------------------------------------------------------------------
def test_openapi_document_has_the_real_status_codes_and_event_streams(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200
    schema = r.json()
    paths = schema["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model_id}", "/tokenize"} <= set(paths)
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for route in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[route]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"]
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "404" in responses
