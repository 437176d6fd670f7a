"""What vLLM's clients send, and tool choice without a parser, through REAL services on the
default model (SmolLM2-135M-Instruct, whose template writes no tool-call tags; float32):

* vLLM's extensions guidellm sends: `max_completion_tokens` on /v1/completions and
  `stream_options.continuous_usage_stats` (every chunk with its choice's usage so far,
  counted as the scheduler counts: the last chunk's equals the final usage);
* tool_choice `required` and a named function with no --tool-call-parser: the answer is
  held to the calls' JSON schema, comes back as OpenAI tool_calls whose arguments validate,
  and ends after the calls; cut by max_tokens it is finish_reason "length" with the text as
  it stands and no call, streamed or not, at every max_tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.helpers.procs import Cluster
from tests.helpers.sweeps import sweep

WAIT_S = 120.0
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
USER = [{"role": "user", "content": "What is the weather in Paris and in Oslo?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]
PARAMETERS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def model_dir(default_model):
    return default_model


@pytest.fixture(scope="module")
def cluster(model_dir):
    worker = ["--dtype", "float32", "--num-blocks", "128"]
    with Cluster(model_dir, worker, ["--max-model-len", "1024"], gateway=True) as c:
        yield c


# ---------------------------------------------------------------- vLLM's extensions


def test_max_completion_tokens_on_completions(oai):
    done = oai.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, extra_body={"max_completion_tokens": 5, "ignore_eos": True}
    )
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(oai, endpoint):
    options = {
        "model": MODEL,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "extra_body": {"ignore_eos": True},
    }
    if endpoint == "chat":
        chunks = list(oai.chat.completions.create(messages=USER, **options))
        done = oai.chat.completions.create(messages=USER, model=MODEL, max_tokens=6, extra_body={"ignore_eos": True})
    else:
        chunks = list(oai.completions.create(prompt=PROMPT, **options))
        done = oai.completions.create(prompt=PROMPT, model=MODEL, max_tokens=6, extra_body={"ignore_eos": True})
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens == done.usage.prompt_tokens
    counts = [c.usage.completion_tokens for c in choice_chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 1
    for chunk in choice_chunks:
        usage = chunk.usage
        assert usage.prompt_tokens == done.usage.prompt_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Without include_usage there is none (vLLM's rule).
    options["stream_options"] = {"continuous_usage_stats": True}
    create = oai.chat.completions.create if endpoint == "chat" else oai.completions.create
    body = {"messages": USER} if endpoint == "chat" else {"prompt": PROMPT}
    assert all(c.usage is None for c in create(**body, **options))


# What guidellm 0.8.1 sends (guidellm/backends/openai/request_handlers.py; not installed: it would
# downgrade click and multidict in the shared environment), streamed with a fixed output length.
GUIDELLM = {
    "/v1/completions": {"prompt": PROMPT, "max_tokens": 6},
    "/v1/chat/completions": {"messages": USER, "max_completion_tokens": 6},
    "/v1/responses": {"input": [{"role": "user", "content": PROMPT}], "max_output_tokens": 6},
}


@pytest.mark.parametrize("path", sorted(GUIDELLM))
def test_guidellms_requests_are_served(cluster, path):
    body = {"model": MODEL, "stream": True, "stop": None, "ignore_eos": True, **GUIDELLM[path]}
    if path != "/v1/responses":
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    with (
        httpx.Client(base_url=cluster.gateway_url, timeout=WAIT_S) as http,
        http.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(d) for d in data if d != "[DONE]"]
    if path == "/v1/responses":
        assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 6
    else:
        assert data[-1] == "[DONE]" and all(e["usage"] is not None for e in events)
        assert events[-1]["usage"]["completion_tokens"] == 6


# ---------------------------------------------------------------- tool choice, no parser


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 3}])
def test_forced_tool_choice_without_a_parser_gives_calls_that_validate_and_end(oai, choice, sampling):
    tool_choice = NAMED if choice == "named" else "required"
    done = oai.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, **sampling
    )
    [answer] = done.choices
    assert answer.finish_reason == ("stop" if choice == "named" else "tool_calls"), answer
    assert answer.message.content is None
    _check_calls(answer.message.tool_calls, {"get_weather"} if choice == "named" else set(PARAMETERS))
    if choice == "named":
        assert len(answer.message.tool_calls) == 1
    # Streamed: the same calls, said whole at the end.
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=300, stream=True, **sampling
        )
    )
    pieces = [p for c in chunks for p in c.choices[0].delta.tool_calls or []]
    streamed = [(p.function.name, p.function.arguments) for p in pieces]
    assert streamed == [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert [c.choices[0].finish_reason for c in chunks][-1] == answer.finish_reason


# A cut at the first token and one inside the arguments in `make test`; the others are slow.
@pytest.mark.parametrize("max_tokens", sweep([1, 3, 7, 12, 20], keep=[1, 12]))
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_cut_by_max_tokens_is_length_with_the_text_as_it_stands(oai, choice, max_tokens):
    tool_choice = NAMED if choice == "named" else "required"
    options = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 0}
    full = oai.chat.completions.create(**options, max_tokens=300)
    done = oai.chat.completions.create(**options, max_tokens=max_tokens)
    [answer] = done.choices
    if done.usage.completion_tokens < full.usage.completion_tokens:
        assert answer.finish_reason == "length" and not answer.message.tool_calls
        assert answer.message.content and done.usage.completion_tokens == max_tokens
        with pytest.raises(json.JSONDecodeError):
            json.loads(answer.message.content)
    else:  # the calls fit
        assert [c.function.arguments for c in answer.message.tool_calls] == [
            c.function.arguments for c in full.choices[0].message.tool_calls
        ]
    chunks = list(oai.chat.completions.create(**options, max_tokens=max_tokens, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == (answer.message.content or "")
    assert bool([p for c in chunks for p in c.choices[0].delta.tool_calls or []]) == bool(answer.message.tool_calls)
    assert chunks[-1].choices[0].finish_reason == answer.finish_reason


def test_auto_without_a_parser_is_refused_naming_the_flags(oai):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=5)
    assert err.value.body["param"] == "tool_choice" and "--tool-call-parser" in err.value.body["message"]
