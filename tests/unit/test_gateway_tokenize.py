"""The gateway's /tokenize, /detokenize, /v1/models' max_model_len and weight format and /metrics,
against an in-process fake serving.v1 scheduler (its "tokenizer": one token
per character, its code point) and a real uvicorn gateway on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway_svc.config import GatewayConfig
from gateway_svc.server import GatewayServer
from proto import serving_pb2, serving_pb2_grpc

VOCAB = 256
MAX_MODEL_LEN = 2048
BOS = 1
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
)
DELTA_DELAY_S = 0.1


class FakeScheduler(serving_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.tokenize_requests: list[serving_pb2.TokenizeRequest] = []
        self.keys: list[str | None] = []
        self.model_info = True

    def _seen(self, context) -> None:
        self.keys.append(dict(context.invocation_metadata()).get("authorization"))

    def Tokenize(self, request, context):
        self._seen(context)
        self.tokenize_requests.append(request)
        ids = [BOS] * request.add_special_tokens + [ord(c) for c in request.prompt]
        strs = [chr(i) for i in ids] if request.return_token_strs else []
        return serving_pb2.TokenizeResponse(token_ids=ids, max_model_len=MAX_MODEL_LEN, token_strs=strs)

    def Detokenize(self, request, context):
        self._seen(context)
        bad = [t for t in request.token_ids if t >= VOCAB]
        if bad:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token_ids: token id {bad[0]} is outside the vocabulary [0, {VOCAB})"
            )
        return serving_pb2.DetokenizeResponse(text="".join(chr(t) for t in request.token_ids))

    def ModelInfo(self, request, context):
        self._seen(context)
        if not self.model_info:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "an older scheduler")
        return serving_pb2.ModelInfoResponse(
            model="m", max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, weight_format="gguf Q4_1+Q8_0"
        )

    def Generate(self, request, context):
        for text in ("a", "b", "c"):
            time.sleep(DELTA_DELAY_S)
            yield serving_pb2.GenerateResponse(request_id=request.request_id, text=text, token_ids=[1])
        yield serving_pb2.GenerateResponse(request_id=request.request_id, finished=True, finish_reason="length")


@pytest.fixture(scope="module")
def fake():
    servicer = FakeScheduler()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    serving_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield servicer
    server.stop(grace=None)


@pytest.fixture(autouse=True)
def _reset(fake):
    fake.tokenize_requests.clear()
    fake.keys.clear()
    fake.model_info = True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("models") / "tok-model"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def gateway(fake, model_dir, **overrides):
    """A real uvicorn gateway in a thread; an httpx client on it (close both with stop())."""
    config = GatewayConfig(host="127.0.0.1", port=0, scheduler=fake.address, model_dir=str(model_dir), **overrides)
    server = GatewayServer(config)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    assert server.ready.wait(10), "gateway did not start"
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10)

    def stop():
        client.close()
        server.stop()
        thread.join(10)

    return client, stop


@pytest.fixture
def http(fake, model_dir):
    client, stop = gateway(fake, model_dir)
    yield client
    stop()


def error(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["param"] == param and body["type"] == "invalid_request_error"
    return body["message"]


# ---- /tokenize, /detokenize ------------------------------------------------------
def test_tokenize_a_prompt_in_vllms_shape(http, fake):
    r = http.post("/tokenize", json={"model": "tok-model", "prompt": "Hi!"})
    assert r.status_code == 200 and r.json() == {
        "count": 4,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": [BOS, 72, 105, 33],
        "token_strs": None,
    }
    r = http.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False, "return_token_strs": True})
    assert r.json() == {"count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [72, 105], "token_strs": ["H", "i"]}
    assert [(q.prompt, q.add_special_tokens) for q in fake.tokenize_requests] == [("Hi!", True), ("Hi", False)]


def test_tokenize_messages_renders_the_chat_template_first(http, fake):
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    r = http.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [ord(c) for c in "<system>s<user>u<a>"]  # no BOS: the template owns it
    http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False, "add_special_tokens": True})
    assert [(q.prompt, q.add_special_tokens) for q in fake.tokenize_requests] == [
        ("<system>s<user>u<a>", False),
        ("<system>s<user>u", True),
    ]


def test_detokenize(http):
    r = http.post("/detokenize", json={"model": "tok-model", "tokens": [72, 105]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hi"}
    assert http.post("/detokenize", json={"model": "x", "tokens": [72]}).json()["error"]["code"] == "model_not_found"
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_bad_input_is_a_400_naming_the_field(http, fake, model_dir):
    assert "exactly one" in error(http.post("/tokenize", json={}), "prompt")
    assert "exactly one" in error(http.post("/tokenize", json={"prompt": "a", "messages": []}), "prompt")
    error(http.post("/tokenize", json={"prompt": ""}), "prompt")
    error(http.post("/tokenize", json={"messages": []}), "messages")
    error(http.post("/tokenize", json={"messages": [{"role": "nobody", "content": "x"}]}), "messages.0.role")
    assert "outside the vocabulary" in error(http.post("/detokenize", json={"tokens": [72, 999]}), "tokens")
    error(http.post("/detokenize", json={"tokens": [-1]}), "tokens.0")
    error(http.post("/detokenize", json={}), "tokens")
    error(http.post("/detokenize", json={"tokens": "72"}), "tokens")
    assert not fake.tokenize_requests  # none of these reached the scheduler's tokenizer
    client, stop = gateway(fake, "")  # completions only: no chat template
    try:
        assert "chat template" in error(client.post("/tokenize", json={"messages": [{"role": "user"}]}), "messages")
    finally:
        stop()


def test_api_key_is_checked_and_passed_on(fake, model_dir):
    client, stop = gateway(fake, model_dir, api_key="sekret")
    try:
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.post("/detokenize", json={"tokens": [1]}).status_code == 401
        ok = {"Authorization": "Bearer sekret"}
        assert client.post("/tokenize", json={"prompt": "x"}, headers=ok).status_code == 200
        assert client.post("/detokenize", json={"tokens": [1]}, headers=ok).status_code == 200
        assert client.get("/v1/models", headers=ok).json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
        assert fake.keys == ["Bearer sekret"] * 3
        assert client.get("/metrics").status_code == 200  # like /health: no key
    finally:
        stop()


# ---- /v1/models ----------------------------------------------------------------------
def test_models_reports_max_model_len_when_the_scheduler_can_say(http, fake):
    [model] = http.get("/v1/models").json()["data"]
    assert model["id"] == "tok-model" and model["max_model_len"] == MAX_MODEL_LEN
    assert model["weight_format"] == "gguf Q4_1+Q8_0"  # the workers' weights as stored (issue 38)
    fake.model_info = False
    [model] = http.get("/v1/models").json()["data"]
    assert model["id"] == "tok-model" and "max_model_len" not in model and "weight_format" not in model


# ---- /metrics ---------------------------------------------------------------------------
def samples(http) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def labels(route, method, status, **extra):
    return tuple(sorted({"route": route, "method": method, "status": str(status), **extra}.items()))


def test_metrics_count_requests_by_route_method_status_and_time_streams_whole(http):
    for _ in range(2):
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200
    assert http.post("/tokenize", json={"prompt": ""}).status_code == 400
    assert http.get("/v1/nope").status_code == 404
    assert http.get("/v1/also/not/here").status_code == 404
    r = http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    got = samples(http)
    total = "pagedserve_gateway_http_requests_total"
    assert got[(total, labels("/tokenize", "POST", 200))] == 2
    assert got[(total, labels("/tokenize", "POST", 400))] == 1
    assert got[(total, labels("other", "GET", 404))] == 2  # unknown paths share one label
    assert got[(total, labels("/v1/completions", "POST", 200))] == 1
    latency = "pagedserve_gateway_http_request_duration_seconds"
    assert got[(f"{latency}_count", labels("/tokenize", "POST", 200))] == 2
    # The stream's three deltas took 3 x 0.1 s: its latency runs to the last byte.
    stream = labels("/v1/completions", "POST", 200)
    assert got[(f"{latency}_sum", stream)] >= 3 * DELTA_DELAY_S
    assert got[(f"{latency}_bucket", labels("/v1/completions", "POST", 200, le="0.25"))] == 0
    assert (total, labels("/metrics", "GET", 200)) not in got  # counted once it has answered
    assert samples(http)[(total, labels("/metrics", "GET", 200))] == 1


# ---- behind --schedulers ------------------------------------------------------------------
def test_tokenize_detokenize_and_models_behind_several_schedulers(fake, model_dir):
    """The pool answers every route the single-scheduler client does, from any healthy scheduler."""
    client, stop = gateway(fake, model_dir, schedulers=f"{fake.address},127.0.0.1:1", scheduler_routing="least-loaded")
    try:
        r = client.post("/tokenize", json={"prompt": "Hi"})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == [BOS, 72, 105] and r.json()["max_model_len"] == MAX_MODEL_LEN
        r = client.post("/detokenize", json={"tokens": [72, 105]})
        assert r.status_code == 200 and r.json() == {"prompt": "Hi"}, r.text
        assert "outside the vocabulary" in error(client.post("/detokenize", json={"tokens": [999]}), "tokens")
        [model] = client.get("/v1/models").json()["data"]
        assert model["max_model_len"] == MAX_MODEL_LEN
    finally:
        stop()
