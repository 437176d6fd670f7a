"""The gateway's edge rules (issues 29 and 35) against the in-process fake scheduler:
the body limit (413 before reading), prompts per request, a request's calls admitted
piecewise, vLLM's `priority` passed on, the cache salt derived from the caller's API
key unless the operator shares the cache, bodies nested too deep refused naming the
field, the scheduler's refusals naming theirs, and the published schema refusing
what the routes refuse."""

from __future__ import annotations

import json

import grpc
import httpx
import jsonschema
import pytest

from gateway_svc.bodies import MAX_NESTING
from gateway_svc.convert import tenant_salt
from gateway_svc.errors import grpc_error
from tests.helpers.fake_scheduler import WAIT_S, assert_openai_error, chat_model_dir, running_gateway, sse_payloads


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("models"))


def gateway(fake_scheduler, model_dir, **config):
    return running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), **config)


def test_a_body_over_the_limit_is_413_whether_announced_or_chunked(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir, max_request_bytes=4096) as url, httpx.Client(base_url=url) as http:
        body = b'{"prompt": "' + b"x" * 5000 + b'"}'
        announced = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        chunked = http.post("/v1/completions", content=iter([body[:3000], body[3000:]]))
        for reply in (announced, chunked):
            error = assert_openai_error(reply, 413)
            assert "--max-request-bytes" in error["message"]
        assert not fake_scheduler.requests  # nothing reached the scheduler
        fits = http.post("/v1/completions", json={"prompt": "x" * 3000})
        assert fits.status_code == 200, fits.text


def test_prompts_per_request_are_limited(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir, max_prompts=3) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        error = assert_openai_error(http.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"]}), 400)
        assert error["param"] == "prompt" and "at most 3 prompts" in error["message"]
        assert http.post("/v1/completions", json={"prompt": ["a", "b", "c"]}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_requests_calls_run_at_most_a_window_at_once(fake_scheduler, model_dir, stream):
    """Six prompts x n=2 with --max-parallel-per-request 3: never more than three calls at
    the scheduler at once, and all twelve choices answered."""
    fake_scheduler.delay_s = 0.02
    config = dict(max_parallel_per_request=3, max_n=4)
    with gateway(fake_scheduler, model_dir, **config) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        body = {"prompt": [f"p{i}" for i in range(6)], "n": 2, "stream": stream}
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        chunks = [json.loads(p) for p in sse_payloads(reply)[:-1]] if stream else [reply.json()]  # then [DONE]
    indexes = {c["index"] for chunk in chunks for c in chunk["choices"]}
    assert indexes == set(range(12)) and len(fake_scheduler.requests) == 12
    assert fake_scheduler.max_active == 3


def test_priority_is_passed_on(fake_scheduler, model_dir):
    with gateway(fake_scheduler, model_dir) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "priority": -3}).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        assert_openai_error(http.post("/v1/completions", json={"prompt": "x", "priority": 2**63}), 400)
    assert [r.priority for r in fake_scheduler.requests] == [-3, 0]


def test_the_cache_salt_comes_from_the_callers_key(fake_scheduler, model_dir):
    with (
        gateway(fake_scheduler, model_dir, cache_salt_from_api_key=True) as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        for key, salt in (("key-a", None), ("key-a", "s"), ("key-b", "s"), (None, "s")):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            body = {"prompt": "x"} | ({"cache_salt": salt} if salt else {})
            assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
    a, a_s, b_s, anonymous = (r.cache_salt for r in fake_scheduler.requests)
    assert a == tenant_salt("key-a", None) and a.startswith("key:") and "key-a" not in a
    assert a_s == f"{a}/s" and b_s == f"{tenant_salt('key-b', None)}/s" and b_s != a_s
    assert anonymous == "s"  # no key: the request's own salt
    # No salt one key's caller can choose is another key's: each starts with its own digest.
    assert not tenant_salt("key-a", "x").startswith(tenant_salt("key-b", None) + "/")


@pytest.mark.parametrize(
    ("required_key", "config", "salted"),
    [
        ("key-a", {}, True),  # keys in force at the scheduler: salted by default (issue 35 item 3)
        (None, {"api_key": "key-a"}, True),  # the gateway's own key
        (None, {}, False),  # no keys anywhere: one tenant, whatever key the client sends
        ("key-a", {"share_prefix_cache_across_keys": True}, False),  # the operator's explicit choice
    ],
)
def test_keys_in_force_give_each_key_its_own_cache_by_default(fake_scheduler, model_dir, required_key, config, salted):
    fake_scheduler.required_key = required_key
    with gateway(fake_scheduler, model_dir, **config) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        body = {"prompt": "x", "cache_salt": "s"}
        reply = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-a"})
        assert reply.status_code == 200, reply.text
    [request] = fake_scheduler.requests
    assert request.cache_salt == (tenant_salt("key-a", "s") if salted else "s")


def nested_schema(levels: int) -> str:
    """A JSON schema of `levels` objects one in the other, as text (json.dumps recurses)."""
    return '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' + "}}" * levels


@pytest.mark.parametrize("levels", [100, 10_000])
def test_a_deeply_nested_schema_is_a_400_naming_the_field(fake_scheduler, model_dir, levels):
    """Issue 35 item 7: on dd5cf58 a 100-level schema was a 500 (the scheduler's
    RecursionError), 10,000 levels the body parser's."""
    with gateway(fake_scheduler, model_dir) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for field, value in (
            ("response_format", '{"type": "json_schema", "json_schema": {"name": "n", "schema": %s}}'),
            ("structured_outputs", '{"json": %s}'),
            ("guided_json", "%s"),
        ):
            body = f'{{"prompt": "x", "{field}": {value % nested_schema(levels)}}}'
            reply = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            error = assert_openai_error(reply, 400)
            assert "nest" in error["message"], error
            if levels < 400:  # the parser's own limit (about 1,000 levels) names no field
                assert error["param"] == field and f"more than {MAX_NESTING} deep" in error["message"], error
    assert not fake_scheduler.requests


def test_the_schedulers_refusals_name_the_field_as_the_request_does():
    """Issue 35 item 10: the README says `param` names the field; on dd5cf58 it was null."""
    refusal = lambda details: grpc_error(grpc.StatusCode.INVALID_ARGUMENT, details)
    assert refusal("max_tokens: must be > 0").param == "max_tokens"
    assert refusal("prompt_token_ids: id 900 is not in the vocabulary").param == "prompt"
    assert refusal("token_ids: id 900 is not in the vocabulary").param == "tokens"
    assert refusal("prompt: 5000 characters; at most 100 can fit").param == "prompt"
    assert refusal("request_id: too long").param is None  # the gateway's own field, not the caller's
    assert grpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue: full").param is None


def test_the_published_schema_refuses_what_the_routes_refuse(fake_scheduler, model_dir):
    """Issue 35 item 10: Schemathesis found schema-valid bodies refused and a refused-by-schema
    body taken. Each case here is checked both ways: the document and the route agree."""
    tool_turn = {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}
    cases = [
        ("/v1/completions", "CompletionRequest", {"prompt": "x", "max_tokens": 0}, False),
        ("/v1/completions", "CompletionRequest", {"prompt": "x", "max_tokens": 0, "echo": True}, True),
        ("/v1/chat/completions", "ChatCompletionRequest", tool_turn, False),
        ("/tokenize", "TokenizeRequest", {}, False),
        ("/tokenize", "TokenizeRequest", {"prompt": ""}, False),
        ("/tokenize", "TokenizeRequest", {"prompt": "x"}, True),
        ("/detokenize", "DetokenizeRequest", {"tokens": [False]}, False),
        ("/detokenize", "DetokenizeRequest", {"tokens": [1]}, True),
    ]
    with gateway(fake_scheduler, model_dir) as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        document = http.get("/openapi.json").json()
        for route, model, body, valid in cases:
            schema = {"$ref": f"#/components/schemas/{model}", "components": document["components"]}
            assert jsonschema.Draft202012Validator(schema).is_valid(body) is valid, (route, body)
            reply = http.post(route, json=body)
            # Refused with 400 exactly when the schema refuses it (the fake scheduler does not tokenize).
            assert (reply.status_code != 400) is valid, (route, body, reply.text)


def test_a_chat_without_a_limit_is_capped_by_the_gateways_default(fake_scheduler, model_dir):
    """Issue 35 item 9: a chat request without max_tokens ran to the whole context."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with gateway(fake_scheduler, model_dir, default_max_tokens=7) as url, httpx.Client(base_url=url) as http:
        for body in (chat, {**chat, "max_tokens": 3}, {**chat, "max_completion_tokens": 2}):
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    unset, max_tokens, max_completion, completion = fake_scheduler.requests
    assert unset.default_max_tokens == 7 and not unset.HasField("max_tokens")
    assert max_tokens.max_tokens == 3 and not max_tokens.HasField("default_max_tokens")
    assert max_completion.max_tokens == 2 and not max_completion.HasField("default_max_tokens")
    assert completion.max_tokens == 16 and not completion.HasField("default_max_tokens")  # OpenAI's 16 there
    fake_scheduler.reset()
    with gateway(fake_scheduler, model_dir, default_max_tokens=0) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert not fake_scheduler.requests[0].HasField("default_max_tokens")  # 0: up to the context


def test_the_key_is_checked_from_the_head_as_bearer_or_x_api_key(fake_scheduler, model_dir):
    """The edge guard answers 401 before reading a body (issue 35 item 6), and takes the key
    as Anthropic's clients send it too; the scheduler gets it as a Bearer key either way."""
    with gateway(fake_scheduler, model_dir, api_key="k1") as url, httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for headers in ({"Authorization": "Bearer k1"}, {"x-api-key": "k1"}):
            assert http.post("/v1/completions", json={"prompt": "x"}, headers=headers).status_code == 200
        for headers in ({}, {"Authorization": "Bearer k2"}, {"x-api-key": "k2"}, {"Authorization": "Basic k1"}):
            error = assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert error["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200 and http.get("/openapi.json").status_code == 200
    assert [m.get("authorization") for m in fake_scheduler.metadata] == ["Bearer k1", "Bearer k1"]
