"""The OpenAI-compatible gateway in front of REAL services: worker (float32, tiny
Llama checkpoint) + scheduler + gateway processes on 127.0.0.1.

Clients are the official `openai` package and httpx; the reference is the
scheduler's own gRPC API (SchedulerClient) on the same processes. After every
test the scheduler must be idle with no block in use (no leak, nothing left
running for a client that went away).
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.helpers.cluster import wait_idle
from tests.helpers.procs import Cluster

MAX_MODEL_LEN = 256  # the scheduler's --max-model-len (the tiny model allows 512)
WAIT_S = 30.0  # upper bound on any single request or wait in this file
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
IGNORE_EOS = {"ignore_eos": True}  # random weights: make output lengths deterministic
MODEL = "llama"  # the gateway's model id: the tiny checkpoint's directory name
pytestmark = pytest.mark.usefixtures("no_leak")  # after every test: idle, no block in use


@pytest.fixture(scope="module")
def cluster(model_dir):
    with Cluster(
        model_dir, ["--dtype", "float32", "--num-blocks", "96"], ["--max-model-len", str(MAX_MODEL_LEN)], gateway=True
    ) as c:
        yield c


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster.gateway_url, timeout=WAIT_S) as client:
        yield client


def chat_prompt(model_dir, messages) -> str:
    """The prompt text transformers renders from the checkpoint's chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def sse_events(response: httpx.Response) -> list[tuple[float, str]]:
    """(arrival time, data) of every server-sent event, read chunk by chunk off the socket."""
    events, buffer = [], ""
    for chunk in response.iter_text():
        buffer += chunk
        while "\n\n" in buffer:
            event, buffer = buffer.split("\n\n", 1)
            assert event.startswith("data: "), event
            events.append((time.monotonic(), event[len("data: ") :]))
    assert buffer == "", f"stream ended inside an event: {buffer!r}"
    return events


# ---------------------------------------------------------------- the openai package


def test_models_and_health(oai, http, model_dir):
    assert [m.id for m in oai.models.list()] == [model_dir.name]
    assert http.get("/health").json() == {"status": "ok"}


def test_tokenize_detokenize_and_max_model_len_with_the_models_tokenizer(oai, http, model_dir):
    """The scheduler's tokenizer behind vLLM's /tokenize and /detokenize, checked
    against transformers' tokenizer of the checkpoint."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dir)
    r = http.post("/tokenize", json={"model": model_dir.name, "prompt": PROMPT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == reference(PROMPT)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] == reference.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": PROMPT}
    # Messages: the chat template, as /v1/chat/completions renders it for the model.
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == reference(chat_prompt(model_dir, MESSAGES), add_special_tokens=False)["input_ids"]
    done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert done.usage.prompt_tokens == chat["count"]
    bad = http.post("/detokenize", json={"tokens": [5, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert "outside the vocabulary" in bad.json()["error"]["message"]
    [model] = http.get("/v1/models").json()["data"]
    assert model["max_model_len"] == MAX_MODEL_LEN
    metrics = http.get("/metrics").text
    assert 'pagedserve_gateway_http_requests_total{method="POST",route="/tokenize",status="200"} 2.0' in metrics
    assert 'route="/detokenize",status="400"} 1.0' in metrics


def test_completion_greedy_equals_grpc(oai, grpc_client):
    want = grpc_client.generate(PROMPT, max_tokens=24, temperature=0.0, timeout=WAIT_S)
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    [choice] = done.choices
    assert choice.text == want.text and want.text
    assert choice.finish_reason == want.finish_reason
    assert done.usage.prompt_tokens == want.prompt_tokens and done.usage.completion_tokens == want.completion_tokens
    # Streamed: the same text, in more than one piece.
    pieces = [
        c.choices[0].text
        for c in oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    ]
    assert "".join(pieces) == want.text
    assert sum(1 for p in pieces if p) > 1


def test_completion_token_id_prompt_and_cached_tokens(oai, grpc_client):
    ids = list(range(5, 45))  # 40 tokens: two full blocks the second request finds cached
    want = grpc_client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, ignore_eos=True, timeout=WAIT_S)
    done = oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, extra_body=IGNORE_EOS)
    assert done.choices[0].text == want.text and done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == 40 and done.usage.completion_tokens == 8
    assert done.usage.prompt_tokens_details.cached_tokens == 32


def test_chat_greedy_equals_grpc_on_the_rendered_template(oai, grpc_client, model_dir):
    want = grpc_client.generate(
        chat_prompt(model_dir, MESSAGES), max_tokens=20, temperature=0.0, ignore_eos=True, timeout=WAIT_S
    )
    done = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0, extra_body=IGNORE_EOS
    )
    [choice] = done.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length" and done.usage.completion_tokens == 20
    assert done.usage.prompt_tokens == want.prompt_tokens
    # Streamed with usage: role first, then the same text, then a usage chunk.
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(oai):
    """Not the scheduler's default of 16: a chat answer is limited only by max_model_len."""
    done = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, extra_body=IGNORE_EOS)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens + done.usage.completion_tokens == MAX_MODEL_LEN


def test_seeded_sampling_is_reproducible_and_n_choices(oai):
    def run():
        return oai.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7, n=3, extra_body=IGNORE_EOS
        )

    first, second = run(), run()
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.completion_tokens == 36


def test_min_p_near_one_keeps_only_the_greedy_token(oai):
    """min_p through the official client reaches the worker's sampler (issue 28):
    at temperature 1.5 the seeded sample wanders off the greedy answer; with min_p 1
    only the most likely token is left at every step, so the answer is greedy's."""

    def complete(**fields):
        extra = {**IGNORE_EOS, **fields.pop("extra", {})}
        done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, extra_body=extra, **fields)
        return done.choices[0].text

    greedy = complete(temperature=0)
    assert complete(temperature=1.5, seed=3) != greedy
    assert complete(temperature=1.5, seed=3, extra={"min_p": 1.0}) == greedy


# ---------------------------------------------------------------- SSE, chunk by chunk


def test_httpx_reads_the_event_stream_chunk_by_chunk(http, grpc_client):
    want = grpc_client.generate(PROMPT, max_tokens=32, temperature=0.0, ignore_eos=True, timeout=WAIT_S)
    body = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1][1] == "[DONE]"
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    # One event per decode step, not one buffered body: they arrive spread over the generation.
    assert len(chunks) >= 16
    assert events[-2][0] > events[0][0]


# ---------------------------------------------------------------- disconnects


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_frees_the_blocks(cluster, http, grpc_client, path):
    # 4 choices of up to ~500 tokens each: far longer than reading 4 events takes,
    # even on this fast tiny model (every choice is a Generate call to cancel).
    n = 4
    body = {"max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True, "n": n}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    got, during = [], None
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                got.append(json.loads(line[len("data: ") :]))
            if len(got) == 4:
                during = grpc_client.stats()
                break  # abandoning the stream closes the connection (httpcore drops it), mid-stream
    assert during.running == n and during.blocks_used > 0, f"the request should still be generating: {during}"
    stats = wait_idle(grpc_client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0), stats
    # Freed because they were cancelled, not because they ran to the end: every choice's
    # Generate call (request id = the response id + the choice index) was aborted.
    deadline = time.monotonic() + 5
    for i in range(n):
        aborted = re.compile(rf"request aborted\s+request_id={got[0]['id']}-{i}\b")
        while not aborted.search(cluster.scheduler.log()):
            assert time.monotonic() < deadline, f"choice {i} was not aborted:\n{cluster.scheduler.log()[-3000:]}"
            time.sleep(0.05)


def test_client_timeout_on_a_non_streaming_request_frees_the_blocks(cluster, grpc_client):
    n, before = 4, grpc_client.stats()
    with httpx.Client(base_url=cluster.gateway_url, timeout=0.3) as short:
        with pytest.raises(httpx.ReadTimeout):
            short.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "n": n})
    stats = wait_idle(grpc_client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0), stats
    # Cancelled, not run to the end: the 4 choices stopped well short of max_model_len.
    generated = stats.generation_tokens_total - before.generation_tokens_total
    assert 0 < generated < n * (MAX_MODEL_LEN - 20), generated


# ---------------------------------------------------------------- errors


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": PROMPT, "top_p": 0}, "top_p"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
    ],
)
def test_bad_parameters_are_400_before_reaching_the_scheduler(http, grpc_client, path, body, param, stream):
    before = grpc_client.stats().requests_finished
    error = assert_openai_error(http.post(path, json={**body, "stream": stream}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert grpc_client.stats().requests_finished == before


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_too_long_is_400_with_the_schedulers_message(http, stream):
    long_prompt = " ".join(["fox"] * (2 * MAX_MODEL_LEN))
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": long_prompt, "stream": stream}), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_plus_max_tokens_beyond_the_context_is_400_naming_it(oai, grpc_client, stream):
    """vLLM's rule, not a silent cut: the answer would have stopped short of max_tokens."""
    prompt_tokens = grpc_client.generate(PROMPT, max_tokens=1, timeout=WAIT_S).prompt_tokens
    fits = MAX_MODEL_LEN - prompt_tokens
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=fits, temperature=0, extra_body=IGNORE_EOS)
    assert done.usage.completion_tokens == fits
    for max_tokens in (fits + 1, 2**31 - 1):
        with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN} tokens") as err:
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=stream)
        # The scheduler's refusal names the field, and so does the gateway's error (issue 35 item 10).
        assert err.value.body["param"] == "max_tokens" and err.value.code == "invalid_argument"
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, stream=stream)


def test_token_id_outside_the_vocabulary_is_400_with_the_schedulers_message(http, grpc_client):
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": [1, 2, 10**6]}), 400)
    assert "outside the vocabulary" in error["message"] and "1000000" in error["message"]
    # Beyond serving.v1's int32: still a 400, never a 500.
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": [1, 2**40]}), 400)
    assert error["param"] == "prompt"


def test_huge_top_k_means_no_limit_and_max_tokens_beyond_int32_is_400(oai, http):
    done = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"top_k": 2**40, **IGNORE_EOS}
    )
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4
    error = assert_openai_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2**40}), 400)
    assert error["param"] == "max_tokens"


def test_openai_client_raises_bad_request_with_the_message(oai):
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {MAX_MODEL_LEN}"):
        oai.completions.create(model=MODEL, prompt=" ".join(["fox"] * (2 * MAX_MODEL_LEN)))
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)


# ---------------------------------------------------------------- latency: Nagle is off


def test_accepted_connections_have_nagle_off():
    """The gateway binds its own socket; asyncio turns TCP_NODELAY on for accepted
    connections only when that socket's proto is TCP. Without it every SSE event
    after the first waited for the client's delayed ACK (~40 ms)."""
    from gateway_svc.server import bind_socket

    async def accepted_nodelay() -> int:
        sock = bind_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname())
            try:
                return await asyncio.wait_for(seen, WAIT_S)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0


def test_keep_alive_requests_are_not_delayed(cluster):
    """Several requests on one keep-alive connection: each well under the 40 ms
    a delayed ACK costs (they took 44 ms each with Nagle on)."""
    host, port = cluster.gateway.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        took = []
        for _ in range(15):
            start = time.perf_counter()
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\n\r\n")
            reply = b""
            while not (b"\r\n\r\n" in reply and reply.endswith(b"}]}")):
                reply += conn.recv(65536)
            took.append(time.perf_counter() - start)
    assert sorted(took)[len(took) // 2] < 0.020, [round(t * 1000, 1) for t in took]
