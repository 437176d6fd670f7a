"""/v1/responses through REAL services (worker, scheduler, gateway; the tiny Llama in fp32),
with the official `openai` client: a plain answer equals chat's greedy answer to the same
messages; streamed, the typed events reassemble to the non-streamed response; a function
tool round trip continues with previous_response_id (the stored conversation re-rendered);
text.format holds the output to a schema; GET / DELETE read and drop the store; what the
API defines and we do not serve is a 400 naming it; a missing id is a 404."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.procs import Cluster
from tests.helpers.tool_models import CITY

WAIT_S = 60.0
MODEL = "llama"
IGNORE_EOS = {"ignore_eos": True}
WEATHER = CITY
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def cluster(model_dir):
    worker = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    gateway = ["--responses-store-size", "4"]
    with Cluster(model_dir, worker, [], gateway=True, gateway_args=gateway) as c:
        yield c


def test_a_plain_response_is_chats_answer_to_the_same_messages(oai):
    done = oai.responses.create(model=MODEL, instructions="Be terse.", input="Name a colour.", max_output_tokens=12,
                                temperature=0)  # fmt: skip
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=12,
        temperature=0,
    )
    assert done.output_text == chat.choices[0].message.content and done.output_text
    assert done.id.startswith("resp_") and done.object == "response" and done.model == MODEL
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    else:
        assert done.status == "completed"
    # The same prompt again: its blocks are cached now.
    again = oai.responses.create(model=MODEL, instructions="Be terse.", input="Name a colour.", max_output_tokens=12,
                                 temperature=0)  # fmt: skip
    assert again.output_text == done.output_text and again.usage.input_tokens_details.cached_tokens > 0


def test_streamed_events_reassemble_to_the_response(oai):
    options = {
        "model": MODEL,
        "input": "Tell a story.",
        "max_output_tokens": 16,
        "temperature": 0,
        "extra_body": IGNORE_EOS,
    }
    done = oai.responses.create(**options)
    events = list(oai.responses.create(**options, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == done.output_text
    final = events[-1].response
    assert final.output_text == done.output_text and final.usage.output_tokens == 16
    assert oai.responses.retrieve(final.id).output_text == done.output_text  # stored at the end of the stream


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_tool_round_trip_with_previous_response_id(oai, stream):
    ask = {"model": MODEL, "input": "Weather in Oslo?", "tools": TOOLS, "tool_choice": "required", "temperature": 0}
    if stream:
        events = list(oai.responses.create(**ask, max_output_tokens=200, stream=True))
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        [done_args] = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert args == done_args
        first = events[-1].response
    else:
        first = oai.responses.create(**ask, max_output_tokens=200)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # The tool's answer continues the stored conversation.
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": -3}'}],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    # The same conversation sent whole, without the store, renders the same prompt.
    whole = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": -3}'},
        ],
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert whole.output_text == second.output_text and whole.usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(whole.id)  # store: false


def test_text_format_holds_the_output_to_the_schema(oai):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    for temperature in (0, 1):
        done = oai.responses.create(model=MODEL, input="Pick a colour.", text={"format": fmt}, max_output_tokens=60,
                                    temperature=temperature)  # fmt: skip
        jsonschema.validate(json.loads(done.output_text), schema)
        assert done.text.format.type == "json_schema"
    done = oai.responses.create(model=MODEL, input="JSON please.", text={"format": {"type": "json_object"}},
                                max_output_tokens=60, temperature=0)  # fmt: skip
    assert isinstance(json.loads(done.output_text), dict)


def test_the_store_is_bounded_and_get_delete_and_missing_ids(oai):
    ids = [oai.responses.create(model=MODEL, input=f"Say {i}.", max_output_tokens=2).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 4: the oldest went
        oai.responses.retrieve(ids[0])
    assert oai.responses.retrieve(ids[-1]).id == ids[-1]
    oai.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(ids[-1])
    with pytest.raises(openai.NotFoundError) as err:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_missing", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"max_output_tokens": "8"}, "max_output_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"no_such_field": 1}, "no_such_field"),
    ],
)
def test_what_we_do_not_serve_is_a_400_naming_it(oai, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", extra_body=fields)
    assert err.value.body["param"] == param, err.value.body
