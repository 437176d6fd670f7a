"""Anthropic's Messages API (/v1/messages) through REAL services (worker, scheduler, gateway;
the tiny Llama in fp32), with the official `anthropic` client: an answer equals chat's
greedy answer to the same conversation; streamed, Anthropic's events reassemble to it;
count_tokens counts what the answer's usage counts; a stop sequence ends the message
with stop_reason stop_sequence naming it; a tool round trip (tool_choice any,
no parser: the calls' JSON schema) gives a tool_use block whose input validates, and the
tool_result continues the conversation; what we do not serve is a 400 naming it, in
Anthropic's error shape."""

from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.helpers.procs import Cluster
from tests.helpers.tool_models import CITY

WAIT_S = 60.0
MODEL = "llama"
SYSTEM = "Be terse."
ASK = [{"role": "user", "content": "Name a colour."}]
WEATHER = CITY
TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER}]
GREEDY = {"extra_body": {"temperature": 0}}  # the current client no longer names sampling fields
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def cluster(model_dir):
    worker = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    with Cluster(model_dir, worker, [], gateway=True) as c:
        yield c


@pytest.fixture(scope="module")
def claude(cluster):
    client = anthropic.Anthropic(base_url=cluster.gateway_url, api_key="unused", max_retries=0, timeout=WAIT_S)
    yield client
    client.close()


def test_a_message_is_chats_answer_and_count_tokens_counts_its_prompt(claude, oai):
    done = claude.messages.create(model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, **GREEDY)
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=12, temperature=0
    )
    [block] = done.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert done.type == "message" and done.role == "assistant" and done.id.startswith("msg_")
    assert done.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    used = done.usage
    assert used.input_tokens + used.cache_read_input_tokens == chat.usage.prompt_tokens
    assert used.output_tokens == chat.usage.completion_tokens
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_reassemble_to_the_message(claude):
    options = {"model": MODEL, "messages": ASK, "max_tokens": 16, "extra_body": {"temperature": 0, "top_k": 1}}
    done = claude.messages.create(**options)
    with claude.messages.stream(**options) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert sum(1 for e in events if e.type == "content_block_delta") > 1
    assert final.content[0].text == done.content[0].text and final.stop_reason == done.stop_reason
    assert final.usage.output_tokens == done.usage.output_tokens
    assert events[0].message.usage.input_tokens == done.usage.input_tokens + done.usage.cache_read_input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(claude, stream):
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    options = {"model": MODEL, "messages": ask, "tools": TOOLS, "tool_choice": {"type": "any"}, "max_tokens": 200,
               **GREEDY}  # fmt: skip
    if stream:
        with claude.messages.stream(**options) as events:
            first = events.get_final_message()
    else:
        first = claude.messages.create(**options)
    [call] = first.content
    assert first.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "-3 C"}
    follow = [*ask, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = claude.messages.create(model=MODEL, messages=follow, max_tokens=8, **GREEDY)
    assert second.content[0].type == "text" and second.usage.input_tokens > first.usage.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_message_and_is_named(claude, stream):
    options = {"model": MODEL, "messages": ASK, "max_tokens": 24, **GREEDY}
    whole = claude.messages.create(**options).content[0].text
    assert len(whole) > 8, whole
    stop = whole[4:7]
    options["stop_sequences"] = ["never in this text", stop]
    if stream:
        with claude.messages.stream(**options) as events:
            done = events.get_final_message()
    else:
        done = claude.messages.create(**options)
    assert (done.stop_reason, done.stop_sequence) == ("stop_sequence", stop)
    assert done.content[0].text == whole[: whole.index(stop)]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content"),
    ],
)
def test_what_we_do_not_serve_is_a_400_naming_it(claude, fields, param):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=fields)
    # Anthropic's error shape: the message names the field.
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith(f"{param}: "), err.value.body
