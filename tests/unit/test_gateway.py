"""gateway_svc against an in-process fake serving.v1 scheduler (no model, no torch).

The fake (tests/helpers/fake_scheduler.py) streams canned deltas and records
every GenerateRequest. Gateways run as real uvicorn servers on 127.0.0.1 port 0
(in a thread, or as a `python -m gateway_svc` process for the CLI); clients are
httpx and the official `openai` package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from gateway_svc.chat_template import ChatTemplate
from tests.helpers.fake_scheduler import (
    DELTAS,
    MODEL_NAME,
    WAIT_S,
    assert_openai_error,
    chat_model_dir,
    running_gateway,
    sse_payloads,
)
from tests.helpers.procs import REPO, ServiceProcess, free_port

# ---------------------------------------------------------------- gateways


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return chat_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def gateway(fake_scheduler, model_dir):
    with running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), max_n=4) as url:
        yield url


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway, timeout=WAIT_S) as client:
        yield client


# ---------------------------------------------------------------- completions


def test_completion_maps_parameters_exactly(http, fake_scheduler):
    body = {
        "model": MODEL_NAME,
        "prompt": "Say hi",
        "max_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.25,
        "seed": 42,
        "stop": ["\n", "END"],
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL_NAME and out["id"].startswith("cmpl-")
    assert out["choices"] == [{"index": 0, "text": "Hello, world", "logprobs": None, "finish_reason": "length"}]
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    [req] = fake_scheduler.requests
    assert req.prompt == "Say hi" and not req.prompt_token_ids
    assert (req.max_tokens, req.temperature, req.top_p, req.seed) == (7, 0.5, 0.25, 42)
    assert list(req.stop) == ["\n", "END"]
    assert not req.HasField("top_k") and not req.ignore_eos


def test_unset_parameters_stay_unset_and_stop_string_becomes_list(http, fake_scheduler):
    r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "stop": "END", "seed": -1})
    assert r.status_code == 200, r.text
    [req] = fake_scheduler.requests
    assert list(req.prompt_token_ids) == [1, 2, 3] and req.prompt == ""
    assert req.max_tokens == 16  # OpenAI's default for /v1/completions (a chat answer may run to the context)
    for name in ("temperature", "top_p", "top_k"):
        assert not req.HasField(name), name  # the scheduler's defaults apply
    assert list(req.stop) == ["END"]
    assert req.seed == 2**64 - 1  # OpenAI's signed seed wrapped into serving.v1's uint64


def test_no_speculation_opts_a_request_out_of_drafts(http, fake_scheduler):
    """pagedserve's extra body field, on both routes, passed as serving.v1's no_speculation;
    anything but a boolean is a 400 naming it."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for route, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", chat)):
        for value in (True, False):
            assert http.post(route, json={**body, "no_speculation": value}).status_code == 200
        assert http.post(route, json=body).status_code == 200
        assert [r.no_speculation for r in fake_scheduler.requests] == [True, False, False]
        fake_scheduler.reset()
        r = http.post(route, json={**body, "no_speculation": "sometimes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "no_speculation", r.text
        assert fake_scheduler.requests == []
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert "pagedserve extension" in schemas[name]["properties"]["no_speculation"]["description"]


def test_logprobs_echo_and_sampling_controls_map_to_serving_v1(http, fake_scheduler):
    controls = {
        "presence_penalty": 0.5,
        "frequency_penalty": -1.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "12": 3.5},
        "min_tokens": 2,
        "stop_token_ids": [2, 9],
    }
    for prompt in ("a", [4, 5]):
        body = {"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 3, **controls}
        assert http.post("/v1/completions", json=body).status_code == 200
    text, ids = fake_scheduler.requests
    for req in (text, ids):
        assert (req.max_tokens, req.logprobs, req.prompt_logprobs) == (0, 3, 3)
        assert (req.presence_penalty, req.frequency_penalty) == (0.5, -1.5)
        assert req.repetition_penalty == pytest.approx(1.2)
        assert dict(req.logit_bias) == {7: -100.0, 12: 3.5}
        assert (req.min_tokens, list(req.stop_token_ids)) == (2, [2, 9])
    fake_scheduler.reset()
    # Echo of a text prompt without logprobs needs no prompt logprobs; of token ids it does (their texts).
    for prompt in ("a", [4, 5]):
        assert http.post("/v1/completions", json={"prompt": prompt, "echo": True}).status_code == 200
    text, ids = fake_scheduler.requests
    assert not text.HasField("prompt_logprobs") and not text.HasField("logprobs")
    assert ids.prompt_logprobs == 0
    fake_scheduler.reset()
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 4, **controls}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    [req] = fake_scheduler.requests
    assert req.logprobs == 4 and not req.HasField("prompt_logprobs") and req.min_tokens == 2
    fake_scheduler.reset()
    assert http.post("/v1/chat/completions", json={**chat, "logprobs": False, "top_logprobs": 0}).status_code == 200
    assert not fake_scheduler.requests[0].HasField("logprobs")


def test_completion_streaming_chunks_and_usage(http, fake_scheduler):
    body = {"prompt": "Say hi", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        r.read()
    payloads = sse_payloads(r)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == "[DONE]"
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert [c["choices"][0]["text"] for c in text_chunks] == DELTAS + [""]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * len(DELTAS) + ["length"]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in text_chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage_chunk["usage"]["total_tokens"] == 8


def test_n_samples_run_concurrently_with_derived_seeds(http, fake_scheduler):
    r = http.post("/v1/completions", json={"prompt": "Say hi", "n": 2, "seed": 7})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["text"] == "Hello, world" for c in out["choices"])
    # The prompt counts once, both samples' output counts.
    assert out["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert sorted(req.seed for req in fake_scheduler.requests) == [7, 8]
    assert len({req.request_id for req in fake_scheduler.requests}) == 2


def test_prompt_batch_times_n(http, fake_scheduler):
    r = http.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "seed": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 10 and out["usage"]["completion_tokens"] == 12
    by_id = {req.request_id.rsplit("-", 1)[1]: (req.prompt, req.seed) for req in fake_scheduler.requests}
    assert by_id == {"0": ("a", 3), "1": ("a", 4), "2": ("b", 3), "3": ("b", 4)}


def test_n_samples_streaming_chat_indexes_choices(http, fake_scheduler):
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        r.read()
    chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "Hello, world"
        assert mine[-1]["finish_reason"] == "length"
    assert len(fake_scheduler.requests) == 2


# ---------------------------------------------------------------- chat


def test_chat_applies_template_and_max_completion_tokens(http, fake_scheduler):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL_NAME, "messages": messages, "max_tokens": 9, "max_completion_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, world"},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    [req] = fake_scheduler.requests
    assert req.prompt == "<s><|system|>Be brief.</s>\n<|user|>Hi there</s>\n<|assistant|>"
    assert req.max_tokens == 4 and req.HasField("temperature") and req.temperature == 0.0


def test_chat_streaming_role_then_content(http, fake_scheduler):
    fake_scheduler.finish_reason = "stop"
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        r.read()
    chunks = [json.loads(p) for p in sse_payloads(r)[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}] + [{"content": d} for d in DELTAS] + [{}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_template_rejection_is_400(http, fake_scheduler):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "hi"}]})
    error = assert_openai_error(r, 400)
    assert "must not start with assistant" in error["message"] and error["param"] == "messages"
    assert not fake_scheduler.requests


def test_chat_template_sources(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config", "eos_token": "E"}))
    assert ChatTemplate.load(tmp_path).render([]) == "from config"
    # chat_template.jinja (current HF layout) wins over tokenizer_config.json.
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}{{ eos_token }}")
    assert ChatTemplate.load(tmp_path).render([{"role": "user", "content": "x"}]) == "xE"
    assert ChatTemplate.load(tmp_path / "missing") is None


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "code,status",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_errors_map_to_http(http, fake_scheduler, code, status, stream):
    fake_scheduler.abort = (code, f"scheduler says {code.name}: prompt of 9000 tokens exceeds the limit 2048")
    r = http.post("/v1/completions", json={"prompt": "x", "stream": stream})
    error = assert_openai_error(r, status)
    assert error["message"] == fake_scheduler.abort[1]  # the gRPC message, verbatim
    assert error["code"] == code.name.lower()


def test_error_mid_stream_is_an_error_event(http, fake_scheduler):
    fake_scheduler.abort, fake_scheduler.abort_after = (grpc.StatusCode.UNAVAILABLE, "worker lost"), 2
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200  # the headers had gone out before the error
        r.read()
    payloads = [json.loads(p) for p in sse_payloads(r)[:-1]]
    assert [c["choices"][0]["text"] for c in payloads[:-1]] == DELTAS[:2]
    assert payloads[-1]["error"]["message"] == "worker lost" and payloads[-1]["error"]["code"] == "unavailable"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 5}, "n"),  # over --max-n 4
        ("/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"fox": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids.0"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": False}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
            "max_completion_tokens",
        ),
    ],
)
def test_bad_parameters_are_openai_400(http, fake_scheduler, path, body, param):
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert not fake_scheduler.requests


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 8.0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
        ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "echo": "false"}, "echo"),
        ("/v1/completions", {"prompt": "x", "seed": "7"}, "seed"),
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage"),
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "true"}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": "2"}, "n"),
    ],
)  # fmt: skip
def test_a_string_where_openai_defines_a_number_or_boolean_is_a_400_naming_it(http, fake_scheduler, path, body, param):
    """Not coerced, as OpenAI and vLLM answer: a typo'd type must not run as some other request."""
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] == param, error
    assert not fake_scheduler.requests


def test_max_completion_tokens_on_completions_wins_over_max_tokens(http, fake_scheduler):
    """vLLM's extension, which guidellm sends on /v1/completions."""
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 9, "max_completion_tokens": 4})
    assert r.status_code == 200, r.text
    r = http.post("/v1/completions", json={"prompt": "x", "max_completion_tokens": 5, "temperature": 1})
    assert r.status_code == 200, r.text  # an integer is a number
    assert [req.max_tokens for req in fake_scheduler.requests] == [4, 5]


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_unknown_route_is_openai_404(http):
    assert_openai_error(http.get("/v1/nope"), 404)


def test_api_key_required_and_forwarded(fake_scheduler, model_dir):
    with (
        running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), api_key="sekret") as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}, headers=headers), 401)
            assert_openai_error(http.get("/v1/models", headers=headers), 401)
        assert not fake_scheduler.requests
        # Anthropic's clients send x-api-key: the same key, on every route, forwarded as Bearer
        # (/v1/messages answers in Anthropic's shape: test_gateway_anthropic.py).
        assert_openai_error(http.post("/v1/responses", json={}, headers={"x-api-key": "wrong"}), 401)
        assert http.post("/v1/messages", json={}, headers={"x-api-key": "wrong"}).status_code == 401
        r = http.post("/v1/completions", json={"prompt": "x"}, headers={"x-api-key": "sekret"})
        assert r.status_code == 200, r.text
        assert fake_scheduler.metadata[-1]["authorization"] == "Bearer sekret"
        ok = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200, ok.text
        assert fake_scheduler.metadata[0]["authorization"] == "Bearer sekret"
        assert http.get("/health").status_code == 200  # probes need no key


def test_scheduler_wanting_a_key_gives_401(http, fake_scheduler):
    fake_scheduler.required_key = "k1"
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}), 401)
    assert "API key" in error["message"]
    ok = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer k1"})
    assert ok.status_code == 200, ok.text


# ---------------------------------------------------------------- models, health


def test_models_lists_the_model_dir_name(http):
    r = http.get("/v1/models")
    assert r.status_code == 200
    [model] = r.json()["data"]
    assert model["id"] == MODEL_NAME and model["object"] == "model"


def test_health_follows_scheduler_health(http, fake_scheduler):
    assert http.get("/health").json() == {"status": "ok"}
    fake_scheduler.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
    finally:
        fake_scheduler.health.set("", health_pb2.HealthCheckResponse.SERVING)


def test_scheduler_down_is_503():
    with (
        running_gateway(scheduler=f"127.0.0.1:{free_port()}", model_dir="", health_timeout_s=1.0) as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        assert http.get("/health").status_code == 503
        assert_openai_error(http.post("/v1/completions", json={"prompt": "x"}), 503)
        # No chat template without a model dir: a clear 400, not a crash.
        assert_openai_error(
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400
        )
        assert http.get("/v1/models").json()["data"][0]["id"] == "pagedserve"


# ---------------------------------------------------------------- disconnect


def test_client_disconnect_cancels_the_grpc_call(http, fake_scheduler):
    fake_scheduler.deltas = [" tok"] * 200
    fake_scheduler.delay_s = 0.02  # 4 s for the whole stream: we leave long before
    got = 0
    with http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got == 3:
                break
    # Leaving the block closed the connection mid-stream.
    assert got == 3
    assert fake_scheduler.cancelled.wait(5.0), "the scheduler's Generate call was not cancelled"


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_before_first_token_cancels(gateway, fake_scheduler, stream):
    fake_scheduler.first_delay_s = 5.0  # nothing comes back for 5 s
    with httpx.Client(base_url=gateway, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": "x", "stream": stream})
    assert fake_scheduler.cancelled.wait(3.0), "the scheduler's Generate call was not cancelled"


# ---------------------------------------------------------------- the openai package


def test_openai_client_streamed_and_not(gateway, fake_scheduler):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-test", max_retries=0, timeout=WAIT_S)
    try:
        done = client.completions.create(model=MODEL_NAME, prompt="Say hi", max_tokens=3, seed=1)
        assert done.choices[0].text == "Hello, world" and done.choices[0].finish_reason == "length"
        assert done.usage.prompt_tokens_details.cached_tokens == 4
        stream = client.completions.create(model=MODEL_NAME, prompt="Say hi", max_tokens=3, stream=True)
        assert "".join(chunk.choices[0].text for chunk in stream) == "Hello, world"
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(chat)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world"
        assert chunks[-1].usage.completion_tokens == 3
        fake_scheduler.abort = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        with pytest.raises(openai.RateLimitError, match="queue full"):
            client.completions.create(model=MODEL_NAME, prompt="x")
    finally:
        client.close()
    assert fake_scheduler.metadata[0]["authorization"] == "Bearer sk-test"  # the caller's key, passed on


def test_cli_process_with_ready_file_and_env(fake_scheduler, model_dir):
    gateway = ServiceProcess(
        "gateway_svc",
        ["--scheduler", fake_scheduler.address, "--model-dir", str(model_dir)],
        env={"PAGEDSERVE_GATEWAY_MODEL_NAME": "from-env"},
    )
    with gateway:
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="x", max_retries=0, timeout=WAIT_S)
        try:
            assert [m.id for m in client.models.list()] == ["from-env"]
            done = client.completions.create(model="from-env", prompt="Say hi")
            assert done.choices[0].text == "Hello, world" and done.model == "from-env"
        finally:
            client.close()
        proc = gateway.proc
    assert proc.returncode == 0, gateway.log()


def test_cli_rejects_bad_flags(capsys):
    from gateway_svc.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["--port", "70000"])
    assert exc.value.code == 2 and "--port" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--scheduler", "nohostport", "--model-dir", ""])
    assert "--scheduler" in capsys.readouterr().err


def test_gateway_never_imports_torch_or_transformers():
    # A fresh interpreter: this one has torch loaded by conftest.
    code = (
        "import sys, gateway_svc.__main__, gateway_svc.server, gateway_svc.app; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
