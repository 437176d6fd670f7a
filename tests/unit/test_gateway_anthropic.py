"""/v1/messages against the fake scheduler: the stop string serving.v1 names on the last
message is Anthropic's stop_sequence (chat still says "stop"), and every refusal on the
/v1/messages routes is Anthropic's error shape, {"type": "error", "error": {type,
message}}, whoever makes it (validation, the edge guard, the scheduler's status codes, a
stream's error event), while the OpenAI routes keep OpenAI's."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx
import pytest

from tests.helpers.fake_scheduler import (
    DELTAS,
    MODEL_NAME,
    WAIT_S,
    assert_openai_error,
    chat_model_dir,
    running_gateway,
)

ASK = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def served(fake_scheduler, tmp_path_factory):
    """The gateway's URL and an httpx client on it (a 4 KiB body limit, for the 413)."""
    model_dir = chat_model_dir(tmp_path_factory.mktemp("models"))
    gateway = running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), max_request_bytes=4096)
    with gateway as url, httpx.Client(base_url=url, timeout=WAIT_S) as client:
        yield url, client


@pytest.fixture
def http(served):
    return served[1]


@pytest.fixture
def claude(served):
    client = anthropic.Anthropic(base_url=served[0], api_key="unused", max_retries=0, timeout=WAIT_S)
    yield client
    client.close()


def assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return str(body["error"]["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_is_stop_sequence_and_eos_end_turn(claude, http, fake_scheduler, stream):
    for stop, reason in (("END", "stop_sequence"), (None, "end_turn")):
        fake_scheduler.finish_reason, fake_scheduler.stop_string = "stop", stop
        options = {**ASK, "stop_sequences": ["END", "STOP"]}
        if stream:
            with claude.messages.stream(**options) as events:
                kinds = [e.type for e in events]
                done = events.get_final_message()
            assert kinds[-1] == "message_stop"
        else:
            done = claude.messages.create(**options)
        assert (done.stop_reason, done.stop_sequence) == (reason, stop)
        assert done.content[0].text == "".join(DELTAS)
    # OpenAI's routes keep finish_reason stop.
    chat = http.post("/v1/chat/completions", json={"messages": ASK["messages"], "stop": ["END"]})
    assert chat.json()["choices"][0]["finish_reason"] == "stop"
    assert fake_scheduler.requests[-1].stop == ["END"]


def test_the_streamed_message_delta_carries_the_stop_sequence(http, fake_scheduler):
    fake_scheduler.finish_reason, fake_scheduler.stop_string = "stop", "END"
    with http.stream("POST", "/v1/messages", json={**ASK, "stream": True, "stop_sequences": ["END"]}) as r:
        text = r.read().decode()
    events = [json.loads(line.removeprefix("data: ")) for line in text.splitlines() if line.startswith("data: ")]
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


@pytest.mark.parametrize(
    "body, status, kind, names",
    [
        ({**ASK, "max_tokens": "8"}, 400, "invalid_request_error", "max_tokens"),
        (
            {**ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            400,
            "invalid_request_error",
            "tools",
        ),  # fmt: skip
        ({**ASK, "model": "another-model"}, 404, "not_found_error", "another-model"),
        ({**ASK, "messages": [{"role": "user", "content": "x" * 5000}]}, 413, "request_too_large", "bytes"),
    ],
)
def test_refusals_on_messages_are_anthropic_errors_naming_what(http, body, status, kind, names):
    assert names in assert_anthropic_error(http.post("/v1/messages", json=body), status, kind)
    counted = body if names == "max_tokens" else {k: v for k, v in body.items() if k != "max_tokens"}
    assert names in assert_anthropic_error(http.post("/v1/messages/count_tokens", json=counted), status, kind)


def test_the_official_client_reads_them(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(**ASK, extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("thinking:")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(**{**ASK, "model": "another-model"})


def test_not_json_and_no_such_method_are_anthropic_errors(http):
    bad = http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_anthropic_error(bad, 400, "invalid_request_error")
    assert_anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")


@pytest.mark.parametrize(
    "code, status, kind",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error"),
        (grpc.StatusCode.UNAVAILABLE, 503, "overloaded_error"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout_error"),
        (grpc.StatusCode.INTERNAL, 500, "api_error"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_scheduler_errors_map_to_anthropic_types(http, fake_scheduler, code, status, kind, stream):
    fake_scheduler.abort = (code, f"scheduler says {code.name}")
    message = assert_anthropic_error(http.post("/v1/messages", json={**ASK, "stream": stream}), status, kind)
    assert message == fake_scheduler.abort[1]
    assert_openai_error(http.post("/v1/chat/completions", json={"messages": ASK["messages"]}), status)


def test_an_error_mid_stream_is_an_anthropic_error_event(http, fake_scheduler):
    fake_scheduler.abort, fake_scheduler.abort_after = (grpc.StatusCode.UNAVAILABLE, "worker lost"), 2
    with http.stream("POST", "/v1/messages", json={**ASK, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    last = text.strip().split("\n\n")[-1]
    assert last.startswith("event: error\n")
    event = json.loads(last.split("data: ", 1)[1])
    assert event == {"type": "error", "error": {"type": "overloaded_error", "message": "worker lost"}}


def test_a_missing_key_is_an_anthropic_authentication_error(fake_scheduler, tmp_path):
    model_dir = chat_model_dir(tmp_path)
    with (
        running_gateway(scheduler=fake_scheduler.address, model_dir=str(model_dir), api_key="sekret") as url,
        httpx.Client(base_url=url, timeout=WAIT_S) as http,
    ):
        assert_anthropic_error(http.post("/v1/messages", json=ASK, headers={"x-api-key": "wrong"}), 401,
                               "authentication_error")  # fmt: skip
        assert_openai_error(http.post("/v1/responses", json={}, headers={"x-api-key": "wrong"}), 401)
        ok = http.post("/v1/messages", json=ASK, headers={"x-api-key": "sekret"})
        assert ok.status_code == 200 and ok.json()["type"] == "message", ok.text
