"""Issue 29 with real processes on 127.0.0.1 (a tiny Llama worker, a scheduler with
two tenants' API keys, the HTTP gateway deriving each key's cache salt):

* tenancy: a salted HTTP request shares cached blocks only with its salt, and two
  API keys never share one (`--cache-salt-from-api-key`); `/v1/models` answers only
  a caller the scheduler takes;
* limits at the edge: a 60 MB body is refused before it is read, 60 MB Generate and
  Tokenize calls are refused unparsed, a multi-megabyte prompt is tokenized off the
  scheduler's event loop, and meanwhile another client's stream keeps flowing;
* bounded metrics: random HTTP methods do not grow /metrics;
* fairness: a short request is served while a 1,000-prompt request runs.
"""

from __future__ import annotations

import random
import socket
import string
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import serving_pb2, serving_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.probe import Prober
from tests.helpers.procs import Cluster, free_port

KEY_A, KEY_B = "tenant-a-key-0123456789", "tenant-b-key-0123456789"
WAIT_S = 120.0
# Prompt characters the scheduler takes (--max-prompt-chars): more than the tiny model's
# context could hold, so that a prompt this long is really tokenized (in a thread).
BIG_PROMPT_CHARS = 1_000_000
MB = 2**20


@pytest.fixture(scope="module")
def cell(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    with Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", "512"],
        ["--api-keys-file", str(keys), "--max-prompt-chars", str(BIG_PROMPT_CHARS)],
        gateway=True,
        gateway_args=["--cache-salt-from-api-key"],
        metrics_port=free_port(),
    ) as cluster:
        yield cluster


def http(cell: Cluster, key: str | None = KEY_A) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=cell.gateway_url, headers=headers, timeout=WAIT_S)


def cached_tokens(client: httpx.Client, ids: list[int], salt: str | None = None) -> int:
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0} | ({"cache_salt": salt} if salt else {})
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def prompt(seed: int, length: int = 40) -> list[int]:
    return random.Random(seed).choices(range(10, 700), k=length)


# ---- tenancy (item 3) ----------------------------------------------------------------------
def test_a_salted_request_shares_cache_only_with_its_salt(cell):
    ids = prompt(1)
    with http(cell) as a:
        assert cached_tokens(a, ids, "x") == 0
        assert cached_tokens(a, ids, "x") == 32  # its two full 16-token blocks
        assert cached_tokens(a, ids, "y") == 0
        assert cached_tokens(a, ids) == 0  # no salt is a namespace of its own too


def test_two_api_keys_never_share_cached_blocks(cell):
    """Even with the same prompt and the same salt: each key's salt starts with its digest,
    so cached_tokens never tells a caller whether someone else sent a prompt."""
    ids = prompt(2)
    with http(cell, KEY_A) as a, http(cell, KEY_B) as b:
        assert cached_tokens(a, ids) == 0
        assert cached_tokens(b, ids) == 0
        assert cached_tokens(b, ids, "shared") == 0
        assert cached_tokens(a, ids, "shared") == 0
        assert cached_tokens(a, ids) == 32 and cached_tokens(b, ids, "shared") == 32  # each its own


def test_models_answers_only_callers_the_scheduler_takes(cell):
    with http(cell, None) as anonymous, http(cell, "not-a-key-of-this-cell") as wrong, http(cell) as a:
        for client in (anonymous, wrong):
            reply = client.get("/v1/models")
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        reply = a.get("/v1/models")
        assert reply.status_code == 200 and reply.json()["data"][0]["max_model_len"] == 512


# ---- limits at the edge, and no blocking (item 4) --------------------------------------------
def raw_http(cell: Cluster, head: bytes, body_part: bytes, timeout_s: float = 10.0) -> bytes:
    """Send a request's head and the first part of its body, then read what comes back
    (without sending the rest): the gateway must answer from the head alone."""
    host, port = cell.gateway.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        sock.sendall(head + body_part)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_60_mb_body_is_refused_before_it_is_read(cell):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY_A}\r\nContent-Length: {60 * MB}\r\n\r\n".encode()
    )
    started = time.perf_counter()
    answer = raw_http(cell, head, b'{"prompt": "' + b"x" * 65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert time.perf_counter() - started < 10.0  # the other 59.9 MB were never sent
    body = answer.split(b"\r\n\r\n", 1)[1]
    if body:
        assert b"--max-request-bytes" in body


def test_a_chunked_body_is_cut_off_at_the_limit(cell):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(16):  # 16 MB without a Content-Length, over the 8 MiB default
            yield b"x" * MB
        yield b'"}'

    with http(cell) as a:
        reply = a.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert reply.status_code == 413 and "--max-request-bytes" in reply.json()["error"]["message"]


def test_huge_inputs_are_refused_or_tokenized_off_the_loop_while_other_streams_flow(cell):
    """The bound: while the large requests below are sent and answered, no event of
    another client's stream waits longer than 2 s + 4 x the longest wait the same
    stream saw over the 2 s before, or half the longest call that tokenized (a loaded
    machine widens both; a blocked loop waits the whole call). Here, on a 2-core
    machine at load 7, the worst wait was about 0.5 s, while the 1M-character prompt
    was tokenized in a thread (CPU contention, not blocking); on d836a24 the scheduler
    tokenized the 60 MB on its event loop: every stream stopped for tens of seconds."""
    channel = grpc.insecure_channel(cell.address, options=[("grpc.max_send_message_length", 100 * MB)])
    stub = serving_pb2_grpc.SchedulerStub(channel)
    key = (("authorization", f"Bearer {KEY_A}"),)
    outcomes: dict[str, str] = {}

    def refused(name: str, call) -> None:
        started = time.perf_counter()
        try:
            call()
            outcomes[name] = "served"
        except grpc.RpcError as err:
            outcomes[name] = f"{err.code().name}: {(err.details() or '')[:160]}"
        outcomes[name + " s"] = f"{time.perf_counter() - started:.2f}"

    huge = "x" * (60 * MB)
    big = "The quick brown fox jumps over the lazy dog. " * (BIG_PROMPT_CHARS // 45)
    with Prober(cell.gateway_url, KEY_A, prompt(3, 8)) as prober:
        time.sleep(3.0)  # started, and a calm window of 2 s
        calm_end = time.monotonic()
        calm = prober.longest_wait(calm_end - 2.0, calm_end)
        refused(
            "generate 60 MB",
            lambda: list(stub.Generate(serving_pb2.GenerateRequest(prompt=huge), metadata=key, timeout=60)),
        )
        refused(
            "tokenize 60 MB", lambda: stub.Tokenize(serving_pb2.TokenizeRequest(prompt=huge), metadata=key, timeout=60)
        )
        refused(
            "request_id 10 MB",
            lambda: list(
                stub.Generate(
                    serving_pb2.GenerateRequest(prompt="hi", request_id="r" * (10 * MB)), metadata=key, timeout=60
                )
            ),
        )
        refused(
            "generate 1M characters",
            lambda: list(stub.Generate(serving_pb2.GenerateRequest(prompt=big), metadata=key, timeout=60)),
        )
        refused(
            "tokenize 1M characters",
            lambda: stub.Tokenize(serving_pb2.TokenizeRequest(prompt=big), metadata=key, timeout=60),
        )
        refused(
            "generate 1.3M characters",
            lambda: list(
                stub.Generate(
                    serving_pb2.GenerateRequest(prompt=big + big[: 3 * len(big) // 10]), metadata=key, timeout=60
                )
            ),
        )
        with http(cell) as a:  # 4 MB of JSON, under the gateway's 8 MiB: parsed, then refused by its length
            reply = a.post("/v1/completions", json={"prompt": big * 4})
            outcomes["http 4M characters"] = f"{reply.status_code}: {reply.text[:160]}"
        attack_end = time.monotonic()
        time.sleep(0.5)  # the probe's next events
        worst = prober.longest_wait(calm_end, attack_end + 0.5)
    channel.close()
    assert outcomes["generate 60 MB"].startswith("RESOURCE_EXHAUSTED"), outcomes
    assert outcomes["tokenize 60 MB"].startswith("RESOURCE_EXHAUSTED"), outcomes
    assert outcomes["request_id 10 MB"].startswith("INVALID_ARGUMENT: request_id"), outcomes
    # Tokenized (in a thread), then too long for the context: refused naming it.
    assert outcomes["generate 1M characters"].startswith("INVALID_ARGUMENT: prompt: this model's maximum"), outcomes
    assert outcomes["tokenize 1M characters"] == "served", outcomes
    # Over --max-prompt-chars: refused by its length, never tokenized.
    over = f"characters; at most {BIG_PROMPT_CHARS} can fit"
    assert (
        outcomes["generate 1.3M characters"].startswith("INVALID_ARGUMENT: prompt: 12")
        and over in outcomes["generate 1.3M characters"]
    ), outcomes
    assert outcomes["http 4M characters"].startswith("400: ") and over in outcomes["http 4M characters"], outcomes
    assert all(float(outcomes[f"{n} s"]) < 30 for n in ("generate 60 MB", "tokenize 60 MB")), outcomes
    # A loop that tokenized on itself would stop every stream for the whole call: half of
    # the longest tokenizing call still catches that, and grows with the machine's load
    # (2.2 s waits beside a 13 s tokenize at load 20+ missed the fixed bound).
    tokenizing = max(float(outcomes[f"{n} s"]) for n in ("generate 1M characters", "tokenize 1M characters"))
    bound = max(2.0 + 4 * calm, 0.5 * tokenizing)
    assert worst < bound, f"a stream waited {worst:.2f} s (bound {bound:.2f} s); {outcomes}"


# ---- bounded metrics labels (item 5) -------------------------------------------------------
def http_series(cell: Cluster) -> set[tuple[tuple[str, str], ...]]:
    text = httpx.get(f"{cell.gateway_url}/metrics", timeout=WAIT_S).text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "pagedserve_gateway_http_requests"]
    return {tuple(sorted(s.labels.items())) for s in family.samples if s.name.endswith("_total")}


def test_random_http_methods_and_paths_do_not_grow_metrics(cell):
    rng = random.Random(5)
    junk = lambda: "".join(rng.choices(string.ascii_uppercase, k=12))
    with httpx.Client(base_url=cell.gateway_url, timeout=WAIT_S) as client:
        for path in ("/v1/models", f"/{junk()}"):  # each series the flood below can reach, once
            client.request(junk(), path)
        http_series(cell)  # and the scrape's own
        before = http_series(cell)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.request(junk(), f"/{junk()}" if i % 2 else "/v1/models"), range(2000)))
    after = http_series(cell)
    assert after == before, sorted(after - before)[:5]
    assert {dict(labels)["method"] for labels in after} <= {"GET", "POST", "other"}


# ---- fairness (item 6) ---------------------------------------------------------------------
def test_a_short_request_is_served_while_a_1000_prompt_request_runs(cell):
    """The batch is admitted piecewise (--max-parallel-per-request, 16 by default): while
    it runs it holds at most that many places of the scheduler, and a request arriving
    after it is served while most of the batch is still to come. On d836a24 all 1,000
    calls queued at once (744 waiting behind 256 running), and the short request was
    served only after the last of them had been admitted: with three quarters done."""
    prompts = [prompt(1000 + i, 8) for i in range(1000)]
    big_reply: list[httpx.Response] = []

    def run_big() -> None:
        with http(cell) as a:
            body = {"prompt": prompts, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            big_reply.append(a.post("/v1/completions", json=body))

    with grpc.insecure_channel(cell.address) as channel:
        stub = serving_pb2_grpc.SchedulerStub(channel)
        stats = lambda: stub.Stats(serving_pb2.StatsRequest(), metadata=(("authorization", f"Bearer {KEY_B}"),))
        finished_before = stats().requests_finished
        big = threading.Thread(target=run_big)
        big.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while (now := stats()).running == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            held = max(now.running + now.waiting, *(s.running + s.waiting for s in (stats() for _ in range(5))))
            with http(cell, KEY_B) as b:
                short = b.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
            done_meanwhile = stats().requests_finished - finished_before - 1  # less the short one
        finally:
            big.join(WAIT_S * 3)
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 2, short.text
    assert held <= 16, f"the batch held {held} places of the scheduler"
    assert done_meanwhile < 500, f"the short request waited for {done_meanwhile} of the batch's 1,000 prompts"
    (reply,) = big_reply
    assert reply.status_code == 200, reply.text[:500]
    choices = reply.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(1000))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert reply.json()["usage"]["completion_tokens"] == 16_000
