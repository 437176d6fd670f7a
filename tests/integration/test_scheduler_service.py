"""The scheduler's client surface over real processes: bad input, queue limits,
cancellation and deadlines, start-up errors, health and reflection."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from proto import serving_pb2
from scheduler_svc.client import SchedulerClient
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import wait_idle
from tests.helpers.procs import REPO, Cluster

MAX_MODEL_LEN = 128
MAX_REQUEST_MB = 1
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)


@pytest.fixture(scope="module")
def cluster():
    # chunk-size 8: a prompt takes several steps to prefill, so cancellation can land mid-prefill.
    with Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", "32"],
        [
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-seqs",
            "2",
            "--max-waiting",
            "2",
            "--max-request-mb",
            str(MAX_REQUEST_MB),
            "--chunk-size",
            "8",
        ],
    ) as c:
        yield c


@pytest.fixture()
def client(cluster):
    with SchedulerClient(cluster.address) as c:
        yield c


BAD_REQUESTS = [
    # (case, GenerateRequest fields, field named in the error)
    ("request_id of 10 kB", {"prompt": "hi", "request_id": "r" * 10_000}, "request_id"),
    ("neither prompt nor ids", {}, "prompt"),
    ("empty strings everywhere", {"prompt": "", "request_id": "", "stop": [""], "cache_salt": ""}, "prompt"),
    ("both prompt and ids", {"prompt": "hi", "prompt_token_ids": [5, 6]}, "prompt"),
    ("id at vocab size", {"prompt_token_ids": [5, 768]}, "prompt_token_ids"),
    ("id at int32 max", {"prompt_token_ids": [5, INT32_MAX]}, "prompt_token_ids"),
    ("negative id", {"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
    ("id at int32 min", {"prompt_token_ids": [INT32_MIN]}, "prompt_token_ids"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("max_tokens int32 min", {"prompt": "hi", "max_tokens": INT32_MIN}, "max_tokens"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("NaN temperature", {"prompt": "hi", "temperature": math.nan}, "temperature"),
    ("infinite temperature", {"prompt": "hi", "temperature": math.inf}, "temperature"),
    ("-infinite temperature", {"prompt": "hi", "temperature": -math.inf}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("top_p above 1", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("negative top_p", {"prompt": "hi", "top_p": -0.1}, "top_p"),
    ("NaN top_p", {"prompt": "hi", "top_p": math.nan}, "top_p"),
    ("infinite top_p", {"prompt": "hi", "top_p": math.inf}, "top_p"),
    ("negative top_k", {"prompt": "hi", "top_k": -1}, "top_k"),
    ("top_k int32 min", {"prompt": "hi", "top_k": INT32_MIN}, "top_k"),
    ("prompt at max model len", {"prompt_token_ids": [7] * MAX_MODEL_LEN}, "prompt"),
    ("prompt far over max model len", {"prompt_token_ids": [7] * 20_000}, "prompt"),
    ("text prompt over max model len", {"prompt": "lorem ipsum " * 2_000}, "prompt"),
    ("too many stop strings", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("stop string too long", {"prompt": "hi", "stop": ["x" * 513]}, "stop"),
    ("n 0", {"prompt": "hi", "n": 0}, "n"),
    ("n negative", {"prompt": "hi", "n": -1}, "n"),
    ("n int32 max", {"prompt": "hi", "n": INT32_MAX}, "n"),
]


def assert_still_serving(client):
    """After any bad input: a good request succeeds and nothing is left holding blocks."""
    good = client.generate("The weather", max_tokens=3, temperature=0.0, ignore_eos=True, timeout=30)
    assert good.completion_tokens == 3 and good.finish_reason == "length"
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("case,fields,field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_invalid_argument_and_service_keeps_serving(client, case, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(serving_pb2.GenerateRequest(**fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    if case.startswith("prompt at max model len"):
        assert str(MAX_MODEL_LEN) in err.value.details()
    assert_still_serving(client)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """One hand-encoded protobuf field (tag, then the payload as given)."""
    return bytes([number << 3 | wire_type]) + payload


def _varint(value: int) -> bytes:
    """A protobuf varint of any value below 2**64 (what a 64-bit field, or a fuzzer, sends)."""
    out = b""
    while True:
        low, value = value & 0x7F, value >> 7
        out += bytes([low | (0x80 if value else 0)])
        if not value:
            return out


def _len_delimited(number: int, data: bytes) -> bytes:
    assert len(data) < 128  # one-byte length varint is all these rows need
    return _field(number, 2, bytes([len(data)]) + data)


_GOOD = serving_pb2.GenerateRequest(prompt="hi", max_tokens=2).SerializeToString()
RAW_REQUESTS = [
    # (case, serialized GenerateRequest, status, text in the details). The generated
    # client would refuse to build these, so they go out as raw bytes.
    (
        "stop with invalid UTF-8",
        _GOOD + _len_delimited(9, b"\xff\xfe"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed request",
    ),
    (
        "prompt with invalid UTF-8",
        _len_delimited(2, b"ok \xc3\x28"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "malformed request",
    ),
    ("truncated message", _len_delimited(2, b"hello")[:-2], grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
    ("garbage bytes", b"\xff\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed request"),
    # A known field with the wrong wire type is kept as an unknown field by protobuf,
    # so max_tokens stays unset and the request then misses a prompt.
    ("max_tokens sent as a string", _len_delimited(4, b"10"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("unknown field only", _field(15, 0, b"\x01"), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    # Issue 29: a varint beyond 32 bits is refused as sent, not as a 32-bit field cuts it
    # (2**32 + 3 would have been max_tokens 3, 2**32 + 5 token id 5, and both served).
    (
        "max_tokens of 2**32 + 3",
        _GOOD + _field(4, 0, _varint(2**32 + 3)),
        grpc.StatusCode.INVALID_ARGUMENT,
        str(2**32 + 3),
    ),
    (
        "token id of 2**32 + 5",
        _field(3, 2, bytes([len(_varint(2**32 + 5))]) + _varint(2**32 + 5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"token id {2**32 + 5}",
    ),
    (
        "n of 2**33",
        _GOOD + _field(11, 0, _varint(2**33)),
        grpc.StatusCode.INVALID_ARGUMENT,
        f"n: must be in [1, 16], got {2**33}",
    ),
    ("top_k of 2**40", _GOOD + _field(7, 0, _varint(2**40)), grpc.StatusCode.INVALID_ARGUMENT, str(2**40)),
    (
        "message over the size limit",
        serving_pb2.GenerateRequest(prompt="x" * (MAX_REQUEST_MB * 2**20 + 1)).SerializeToString(),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
]


@pytest.mark.parametrize("case,raw,code,text", RAW_REQUESTS, ids=[c[0] for c in RAW_REQUESTS])
def test_malformed_request_bytes_get_a_clear_status(client, case, raw, code, text):
    call = client.channel.unary_stream(
        "/serving.v1.Scheduler/Generate",
        request_serializer=lambda b: b,
        response_deserializer=serving_pb2.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as err:
        list(call(raw, timeout=30))
    assert err.value.code() == code, err.value.details()
    assert text in err.value.details()
    assert_still_serving(client)


EXTREME_BUT_VALID = [
    # (case, GenerateRequest fields); each streams 3 tokens unless max_tokens says otherwise
    ("top_k at int32 max", {"top_k": INT32_MAX}),
    ("huge temperature", {"temperature": 1e30}),
    ("tiny top_p", {"top_p": 1e-30}),
    ("seed at uint64 max", {"seed": 2**64 - 1}),
    ("empty stop strings are ignored", {"stop": ["", ""]}),
    ("16 stop strings of 512 characters", {"stop": [chr(0x4E00 + i) * 512 for i in range(16)]}),
    ("cache_salt of 100 kB", {"cache_salt": "s" * 100_000}),
    ("request_id of 256 characters", {"request_id": "r" * 256}),
    ("non-ASCII prompt and stop", {"prompt": "héllo wörld 🌍 ", "stop": ["🌍🌍"]}),
    ("token id 0 only", {"prompt": "", "prompt_token_ids": [0] * 5}),
]


@pytest.mark.parametrize("case,fields", EXTREME_BUT_VALID, ids=[c[0] for c in EXTREME_BUT_VALID])
def test_extreme_but_valid_values_are_served(client, case, fields):
    params = {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True, **fields}
    replies = list(client.stub.Generate(serving_pb2.GenerateRequest(**params), timeout=30))
    assert replies[-1].finished and replies[-1].usage.completion_tokens == 3
    assert sum(len(r.token_ids) for r in replies) == 3
    assert all(r.request_id == (fields.get("request_id") or replies[0].request_id) for r in replies)
    assert_still_serving(client)


def test_max_tokens_beyond_the_context_is_refused_and_unset_runs_up_to_it(client):
    """The context rule (validation.output_limit): never a silent cut."""
    prompt = list(range(10, 30))
    for max_tokens in (INT32_MAX, MAX_MODEL_LEN - len(prompt) + 1):
        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompt_token_ids=prompt, max_tokens=max_tokens, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err.value.details()
    out = client.generate(prompt_token_ids=prompt, temperature=0.0, ignore_eos=True, timeout=60)
    assert out.finish_reason == "length"
    assert out.completion_tokens == MAX_MODEL_LEN - len(prompt)
    assert_still_serving(client)


def test_request_id_in_use_is_invalid_argument(client):
    first = client.stream(
        prompt_token_ids=[11] * 5, max_tokens=100, temperature=0.0, ignore_eos=True, request_id="dup", timeout=60
    )
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("again", max_tokens=2, request_id="dup", timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in err.value.details()
    first.cancel()
    assert_still_serving(client)


def test_full_queue_is_resource_exhausted(client):
    # max-num-seqs 2 and max-waiting 2: two run, two wait, the fifth is refused.
    def open_stream(i):
        return client.stream(
            prompt_token_ids=[10 + i] * 5, max_tokens=100, temperature=0.0, ignore_eos=True, timeout=60
        )

    running = [open_stream(i) for i in range(2)]
    for s in running:
        next(s)
    waiting = [open_stream(i) for i in range(2, 4)]
    deadline = time.monotonic() + 10
    while client.stats().waiting < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("one too many", max_tokens=1, timeout=30))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting" in err.value.details()
    for s in running + waiting:
        s.cancel()
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_cancel_mid_stream_frees_blocks(client):
    stream = client.stream(
        prompt_token_ids=list(range(20, 60)), max_tokens=80, temperature=0.0, ignore_eos=True, timeout=60
    )
    got = [next(stream) for _ in range(3)]
    assert client.stats().blocks_used > 0 and got
    stream.cancel()
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_cancel_mid_prefill_frees_blocks(cluster, client):
    # 120 prompt tokens in chunks of 8: the first message is prefill progress, not a token.
    stream = client.stream(
        prompt_token_ids=list(range(20, 140)),
        max_tokens=8,
        temperature=0.0,
        ignore_eos=True,
        request_id="cancel-mid-prefill",
        timeout=60,
    )
    first = next(stream)
    assert first.HasField("prefill_progress") and not first.token_ids
    assert first.prefill_progress.processed_tokens < first.prefill_progress.total_tokens == 120
    stream.cancel()
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)
    assert re.search(r"request aborted\s+request_id=cancel-mid-prefill", cluster.scheduler.log())


def test_deadline_while_decoding_frees_blocks(client):
    # 88 tokens take ~0.3 s on the tiny model; the deadline hits mid-decode.
    with pytest.raises(grpc.RpcError) as err:
        list(
            client.stream(
                prompt_token_ids=list(range(20, 60)), max_tokens=88, temperature=0.0, ignore_eos=True, timeout=0.1
            )
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_deadline_while_queued_drops_the_request(client):
    # max-num-seqs 2: two long streams hold the running slots, the third waits.
    holders = [
        client.stream(prompt_token_ids=[40 + i] * 5, max_tokens=120, temperature=0.0, ignore_eos=True, timeout=60)
        for i in range(2)
    ]
    for h in holders:
        next(h)
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream("queued", max_tokens=4, timeout=0.05))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while client.stats().waiting and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.stats().waiting == 0
    for h in holders:
        h.cancel()
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_stop_string_ends_the_stream_without_the_stop_text(client):
    full = client.generate(prompt_token_ids=list(range(30, 45)), max_tokens=24, temperature=0.0, ignore_eos=True)
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = client.generate(
        prompt_token_ids=list(range(30, 45)), max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]
    )
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_the_last_message_names_the_stop_string_or_stop_token_that_ended_it(client):
    greedy = {"prompt_token_ids": list(range(30, 45)), "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    full = client.generate(**greedy)
    stop, token = full.text[3:6], full.token_ids[5]

    def last(**params):
        [end] = [r for r in client.stream(**greedy, **params) if r.finished]
        return end

    by_string = last(stop=["never in this text", stop])
    assert (by_string.finish_reason, by_string.WhichOneof("stopped_by")) == ("stop", "stop_string")
    assert by_string.stop_string == stop
    by_token = last(stop_token_ids=[token])
    assert (by_token.finish_reason, by_token.WhichOneof("stopped_by"), by_token.stop_token_id) == (
        "stop",
        "stop_token_id",
        token,
    )
    by_length = last()
    assert (by_length.finish_reason, by_length.WhichOneof("stopped_by")) == ("length", None)


def test_seeded_sampling_reproducible_through_the_service(client):
    runs = [
        client.generate("Once upon", max_tokens=12, temperature=1.0, seed=42, ignore_eos=True).token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]


def test_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="serving.v1.Scheduler"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert "serving.v1.Scheduler" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_unknown_worker_address_is_a_clear_startup_error():
    started = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--workers",
            "127.0.0.1:1",
            "--model",
            str(tiny_checkpoint("llama")),
            "--port",
            "0",
            "--connect-timeout-s",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "127.0.0.1:1" in result.stderr and "start-up failed" in result.stderr
    assert time.monotonic() - started < 30


def test_bad_flag_is_a_clear_error_naming_it():
    result = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--chunk-size", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--chunk-size" in result.stderr and ">= 1" in result.stderr
