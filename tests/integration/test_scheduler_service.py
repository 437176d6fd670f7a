"""The scheduler's client surface over real processes: bad input, queue limits,
cancellation and deadlines, start-up errors, health and reflection."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from proto import serving_pb2
from scheduler_svc.client import SchedulerClient
from tests.conftest import tiny_checkpoint
from tests.integration.test_end_to_end import wait_idle
from tests.procs import REPO, Cluster

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def cluster():
    with Cluster(tiny_checkpoint("llama"), ["--dtype", "float32", "--num-blocks", "32"],
                 ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2", "--max-waiting", "2"]) as c:
        yield c


@pytest.fixture()
def client(cluster):
    with SchedulerClient(cluster.address) as c:
        yield c


BAD_REQUESTS = [
    # (case, GenerateRequest fields, field named in the error)
    ("neither prompt nor ids", {}, "prompt"),
    ("both prompt and ids", {"prompt": "hi", "prompt_token_ids": [5, 6]}, "prompt"),
    ("id at vocab size", {"prompt_token_ids": [5, 768]}, "prompt_token_ids"),
    ("negative id", {"prompt_token_ids": [5, -1]}, "prompt_token_ids"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    ("negative temperature", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("NaN temperature", {"prompt": "hi", "temperature": math.nan}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0.0}, "top_p"),
    ("top_p above 1", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("negative top_k", {"prompt": "hi", "top_k": -1}, "top_k"),
    ("prompt at max model len", {"prompt_token_ids": [7] * MAX_MODEL_LEN}, "prompt"),
    ("too many stop strings", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
]


@pytest.mark.parametrize("case,fields,field", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_invalid_argument_and_service_keeps_serving(client, case, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(serving_pb2.GenerateRequest(**fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    if case == "prompt at max model len":
        assert str(MAX_MODEL_LEN) in err.value.details()
    good = client.generate("The weather", max_tokens=3, temperature=0.0, ignore_eos=True, timeout=30)
    assert good.completion_tokens == 3 and good.finish_reason == "length"
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_full_queue_is_resource_exhausted(client):
    # max-num-seqs 2 and max-waiting 2: two run, two wait, the fifth is refused.
    def open_stream(i):
        return client.stream(prompt_token_ids=[10 + i] * 5, max_tokens=100, temperature=0.0, ignore_eos=True,
                             timeout=60)

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
    stream = client.stream(prompt_token_ids=list(range(20, 60)), max_tokens=80, temperature=0.0, ignore_eos=True,
                           timeout=60)
    got = [next(stream) for _ in range(3)]
    assert client.stats().blocks_used > 0 and got
    stream.cancel()
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_deadline_while_decoding_frees_blocks(client):
    # 88 tokens take ~0.3 s on the tiny model; the deadline hits mid-decode.
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(prompt_token_ids=list(range(20, 60)), max_tokens=88, temperature=0.0, ignore_eos=True,
                           timeout=0.1))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_idle(client)
    assert (stats.running, stats.waiting, stats.blocks_used) == (0, 0, 0)


def test_deadline_while_queued_drops_the_request(client):
    # max-num-seqs 2: two long streams hold the running slots, the third waits.
    holders = [client.stream(prompt_token_ids=[40 + i] * 5, max_tokens=120, temperature=0.0, ignore_eos=True,
                             timeout=60) for i in range(2)]
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
    cut = client.generate(prompt_token_ids=list(range(30, 45)), max_tokens=24, temperature=0.0, ignore_eos=True,
                          stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_seeded_sampling_reproducible_through_the_service(client):
    runs = [client.generate("Once upon", max_tokens=12, temperature=1.0, seed=42, ignore_eos=True).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_health_and_reflection(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="serving.v1.Scheduler"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert "serving.v1.Scheduler" in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_unknown_worker_address_is_a_clear_startup_error():
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "scheduler_svc", "--workers", "127.0.0.1:1", "--model", str(tiny_checkpoint("llama")),
         "--port", "0", "--connect-timeout-s", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "127.0.0.1:1" in result.stderr and "start-up failed" in result.stderr
    assert time.monotonic() - started < 30


def test_bad_flag_is_a_clear_error_naming_it():
    result = subprocess.run([sys.executable, "-m", "scheduler_svc", "--chunk-size", "0"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--chunk-size" in result.stderr and ">= 1" in result.stderr
