"""Structured outputs and tool calling through REAL services (worker, scheduler,
gateway with --tool-call-parser hermes, a tiny random-weight Llama in fp32
with room for a prompt that lists tools: the tiny tokenizer spends ~450 tokens on two),
checked with the official `openai` client: the mask alone must make a random
model's output valid. `chat.completions.parse` returns the Pydantic object;
generated JSON schemas always validate; regex, choice and grammar outputs
match; tool_choice required and a named function always give tool calls that
parse and validate; a streamed answer reassembles to the non-streamed one; a
bad schema, regex or grammar is a 400 naming the field; and after every test
no block is left in use."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from pydantic import BaseModel, Field

from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import Cluster
from tests.helpers.schema_strategies import SCHEMAS
from tests.helpers.tool_models import tool_model_dir

WAIT_S = 60.0
MODEL = "tool-llama"
ASK = [{"role": "user", "content": "Answer in the required format."}]
pytestmark = pytest.mark.usefixtures("no_leak")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tool_model_dir(tmp_path_factory.mktemp("models") / MODEL, tiny_checkpoint("llama_long"))


@pytest.fixture(scope="module")
def cluster(model_dir):
    worker = ["--dtype", "float32", "--num-blocks", "256", "--max-model-len", "2048"]
    with Cluster(
        model_dir, worker, [], gateway=True, gateway_args=["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    ) as c:
        yield c


class Pet(BaseModel):
    name: str = Field(min_length=1, max_length=12)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    toys: list[Literal["ball", "rope", "bone"]] = Field(max_length=3)


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_parse_returns_the_pydantic_object(oai, seed):
    sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
    done = oai.chat.completions.parse(model=MODEL, messages=ASK, response_format=Pet, max_tokens=200, **sampling)
    [choice] = done.choices
    assert choice.finish_reason == "stop"
    pet = choice.message.parsed
    assert isinstance(pet, Pet) and Pet.model_validate_json(choice.message.content) == pet


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_generated_json_schemas_always_validate(oai, schema):
    """Nested objects, arrays with bounds, enums, numbers with ranges, required and optional
    properties: greedy and sampled answers of a random model, validated."""
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7}):
        done = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=400,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
            **sampling,
        )
        [choice] = done.choices
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_regex_choice_grammar_and_json_object_outputs_match(oai):
    regex = r"[A-Z][a-z]{1,8} [0-9]{1,3}(\.[0-9])?"
    for seed in range(3):
        sampling = {"temperature": 1.0, "seed": seed}
        text = oai.completions.create(
            model=MODEL, prompt="Code:", max_tokens=30, extra_body={"structured_outputs": {"regex": regex}}, **sampling
        ).choices[0]
        assert text.finish_reason == "stop" and re.fullmatch(regex, text.text), text.text
        choice = oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=10, extra_body={"guided_choice": ["left", "right", "up"]}, **sampling
        )
        assert choice.choices[0].message.content in ("left", "right", "up")
        listing = oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=60,
            extra_body={"structured_outputs": {"grammar": 'start: "[" num (", " num)* "]"\nnum: /[1-9][0-9]?/'}},
            **sampling,
        ).choices[0]
        assert listing.finish_reason == "stop" and re.fullmatch(
            r"\[[1-9][0-9]?(, [1-9][0-9]?)*\]", listing.message.content
        )
        obj = oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=300, response_format={"type": "json_object"}, **sampling
        ).choices[0]
        if obj.finish_reason == "stop":  # free-form JSON may run past max_tokens; when it ends, it is an object
            assert isinstance(json.loads(obj.message.content), dict)


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": TIME}


def _check_calls(calls, names) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_tool_choice_always_give_calls_that_parse(oai, seed):
    sampling = {"temperature": 1.0, "seed": seed} if seed else {"temperature": 0.0}
    done = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, **sampling
    )
    [choice] = done.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    _check_calls(choice.message.tool_calls, SCHEMA_OF)
    named = {"type": "function", "function": {"name": "get_time"}}
    done = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=100, **sampling
    )
    [choice] = done.choices
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1  # OpenAI's finish for a named call
    _check_calls(choice.message.tool_calls, ["get_time"])


def test_streamed_tool_call_deltas_reassemble_to_the_non_streamed_answer(oai):
    request = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=300, temperature=0.0)
    whole = oai.chat.completions.create(**request).choices[0]
    calls: dict[int, dict[str, str]] = {}
    pieces, reasons = 0, []
    for chunk in oai.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            if piece.id is not None:
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
            pieces += 1
        reasons.append(chunk.choices[0].finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    assert pieces > len(calls) and reasons[-1] == whole.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nothing"}}}},
         "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_a_bad_schema_regex_or_grammar_is_a_400_naming_the_field(oai, extra, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, stream=stream, extra_body=extra)
        assert err.value.body["param"] == param and err.value.body["message"].startswith(param)


def test_what_a_constraint_cannot_go_with_is_a_400_naming_the_field(oai):
    regex = {"structured_outputs": {"regex": "[a-z]+"}}
    for extra, param in (({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 2}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body={**regex, **extra})
        assert param in err.value.body["message"]
