"""Prefill/decode disaggregation over real processes (tiny llama, float32): one
prefill worker and one decode worker behind a scheduler. Every request's prompt runs
on the prefill worker (in chunks), its KV moves to the decode worker (FetchBlocks ->
ReadBlocks) and it decodes there; greedy tokens equal transformers' throughout,
with preemption, structured outputs and n-gram speculation on the decode side. A
prompt the decode worker already holds moves no block; a prefill worker killed while
its blocks are being read leaves the request to recompute on the decode worker,
still exact. Every scheduler's log shows no internal error and no failed audit."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proto import worker_pb2, worker_pb2_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.structured import Constraint
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import SPEC_FLAGS, hf_greedy, wait_idle
from tests.helpers.grammar_reference import reference
from tests.helpers.procs import ServiceProcess, running
from tests.helpers.recorder import finished_records, wait_for
from tools import certs

MODEL = tiny_checkpoint("llama")  # the conftest's model_dir: `model` is its transformers reference
BLOCK = 16
WORKER = ["--model", str(MODEL), "--dtype", "float32", "--num-blocks", "128", "--block-size", str(BLOCK)]
# A 32-token step budget: every prompt longer than that is prefilled in chunks.
CHUNKED = ["--max-num-batched-tokens", "32"]


@pytest.fixture(scope="module")
def pair():
    """(prefill worker, decode worker), shared by the tests; each test has its own scheduler."""
    with running(
        [
            ServiceProcess("worker_svc", [*WORKER, "--kv-role", "prefill"]),
            ServiceProcess("worker_svc", [*WORKER, "--kv-role", "decode"]),
        ]
    ) as procs:
        yield procs


@contextlib.contextmanager
def scheduler(workers: list[ServiceProcess], *args: str):
    with ServiceProcess(
        "scheduler_svc",
        ["--model", str(MODEL), "--workers", ",".join(w.address for w in workers), "--log-format", "json", *args],
    ) as proc:
        with SchedulerClient(proc.address) as client:
            yield proc, client
            wait_idle(client)
        log = proc.log_path.read_text(errors="replace")
        for sign in ("Traceback", "engine core failed", "engine audit failed", "kv handoff failed"):
            assert sign not in log, log[-4000:]


def prompts(seed: int, count: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 700) for _ in range(rng.randrange(low, high))] for _ in range(count)]


def generate_all(client: SchedulerClient, cases: list[tuple[list[int], int]], **params):
    def run(case):
        ids, max_tokens = case
        return client.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=0.0, timeout=180, **params)

    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(run, cases))


def test_prefill_then_decode_on_another_worker_is_token_exact(pair, model):
    prefill, decode = pair
    cases = [(ids, 6 + i) for i, ids in enumerate(prompts(1, 8, 20, 100))]
    with scheduler(pair, *CHUNKED) as (proc, client):
        results = generate_all(client, cases)
        stats = wait_idle(client)
        records = finished_records(proc)
    for (ids, max_tokens), got in zip(cases, results):
        assert got.token_ids == hf_greedy(model, ids, max_tokens)
        assert got.cached_prompt_tokens == 0  # the moved KV is no prefix hit of the request's
    assert {r["worker"] for r in records.values()} == {decode.address}  # every request ended there
    full_blocks = sum(len(ids) // BLOCK for ids, _ in cases)
    roles = {w.address: w.kv_role for w in stats.workers}
    assert roles == {prefill.address: "prefill", decode.address: "decode"}
    per_block = next(w.kv_bytes_per_token for w in stats.workers) * BLOCK
    assert (stats.kv_handoffs, stats.kv_handoffs_stayed, stats.kv_transfers_failed) == (8, 0, 0)
    assert stats.kv_transfer_blocks == full_blocks and stats.kv_transfer_blocks_skipped == 0
    assert stats.kv_transfer_bytes == full_blocks * per_block
    assert stats.kv_transfer_queue_depth == 0 and stats.kv_transfer_seconds > 0
    # The decode worker computed only each prompt's partial last block and first token.
    decode_stats = next(w for w in stats.workers if w.address == decode.address)
    assert (decode_stats.running, decode_stats.blocks_used) == (0, 0)


def test_prefix_the_decode_worker_holds_is_not_moved_again(pair, model):
    (ids,) = prompts(2, 1, 70, 71)  # 4 full blocks and 6 tokens
    want = hf_greedy(model, ids, 8)
    with scheduler(pair) as (_, client):
        first = client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, timeout=120)
        moved = wait_idle(client)
        again = client.generate(prompt_token_ids=ids, max_tokens=8, temperature=0.0, timeout=120)
        stats = wait_idle(client)
    assert first.token_ids == again.token_ids == want
    assert (moved.kv_transfer_blocks, moved.kv_transfer_blocks_skipped) == (4, 0)
    # The second time the prefill worker's cache holds the prompt (cached_prompt_tokens) and
    # the decode worker's too: no block moves, no FetchBlocks at all.
    assert again.cached_prompt_tokens == 64
    assert (stats.kv_transfer_blocks, stats.kv_transfer_blocks_skipped) == (4, 4)
    assert (stats.kv_transfers, stats.kv_handoffs) == (1, 2)


def test_without_prefix_caching_the_decode_worker_computes_only_each_prompts_tail(pair, model):
    # No index to find the moved blocks in: the request takes them as its prefix all the same.
    cases = [(ids, 5) for ids in prompts(4, 4, 40, 90)]
    with scheduler(pair, "--no-prefix-caching") as (_, client):
        results = generate_all(client, cases)
        stats = wait_idle(client)
    for (ids, max_tokens), got in zip(cases, results):
        assert got.token_ids == hf_greedy(model, ids, max_tokens)
    full_tokens = sum(len(ids) // BLOCK * BLOCK for ids, _ in cases)
    assert (stats.kv_handoffs, stats.kv_transfer_blocks) == (4, full_tokens // BLOCK)
    # On the decode worker: the moved tokens resumed, only the tail and first token computed.
    assert stats.resumed_tokens == full_tokens
    assert stats.recomputed_tokens == sum(len(ids) + 1 for ids, _ in cases) - full_tokens


def test_preemption_on_the_decode_worker_stays_exact(pair, model):
    # 12 x (30 + 180 tokens) want ~168 blocks of the decode worker's 128: they preempt each other
    # there. Twelve shorter requests rather than six of 400 tokens: under half the decode
    # steps for the same overflow.
    cases = [(ids, 180) for ids in prompts(3, 12, 25, 35)]
    with scheduler(pair, *CHUNKED) as (proc, client):
        results = generate_all(client, cases, ignore_eos=True)
        records = finished_records(proc)
    for (ids, max_tokens), got in zip(cases, results):
        assert got.token_ids == hf_greedy(model, ids, max_tokens, ignore_eos=True)
    assert sum(r["preemptions"] for r in records.values()) > 0


def test_structured_outputs_and_ngram_drafts_on_the_decode_worker(pair, model, compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}}}
    constrained = [(ids, 60) for ids in prompts(4, 3, 20, 60)]
    free = [(ids, 40) for ids in prompts(5, 3, 20, 60)]
    with scheduler(pair, *CHUNKED, *SPEC_FLAGS) as (_, client):
        shaped = generate_all(client, constrained, json_schema=json.dumps(schema))
        plain = generate_all(client, free)
        stats = wait_idle(client)
    for (ids, max_tokens), got in zip(constrained, shaped):
        assert got.token_ids == reference(model, compiler, ids, Constraint.json_schema(schema), max_tokens)
    for (ids, max_tokens), got in zip(free, plain):
        assert got.token_ids == hf_greedy(model, ids, max_tokens)
    assert stats.kv_handoffs == 6
    assert stats.spec_decode_drafts > 0  # drafted on the decode worker: the prefill worker never decodes


def test_prefill_worker_killed_mid_transfer_recomputes_on_the_decode_worker(pair, model):
    _, decode = pair
    slow = ServiceProcess(
        "tests.helpers.slow_block_source",
        [*WORKER, "--kv-role", "prefill"],
        env={"PAGEDSERVE_TEST_READ_DELAY_S": "30"},
    )
    (ids,) = prompts(6, 1, 90, 91)
    want = hf_greedy(model, ids, 12)
    with running([slow]), scheduler([slow, decode], "--worker-timeout-s", "60") as (_, client):
        result = {}
        thread = threading.Thread(
            target=lambda: result.update(
                got=client.generate(prompt_token_ids=ids, max_tokens=12, temperature=0.0, timeout=120)
            )
        )
        thread.start()
        wait_for(lambda: client.stats().kv_transfer_queue_depth == 1, 60, "the transfer to start")
        slow.kill()  # its blocks half-way to the decode worker
        thread.join(120)
        stats = wait_idle(client)
    assert result["got"].token_ids == want
    assert (stats.kv_transfers_failed, stats.kv_transfers, stats.kv_transfer_blocks) == (1, 0, 0)
    assert stats.kv_handoffs == 1  # it moved anyway, and the decode worker computed the prompt


def test_a_source_dialled_by_ip_is_verified_against_the_tls_server_name_the_scheduler_sends(tmp_path):
    """Workers serving mutual TLS, as on Kubernetes: the prefill worker's certificate names
    only its Service (no IP), and the decode worker dials it by address. FetchBlocks with
    source_tls_server_name moves the blocks; without it the decode worker refuses the
    source's certificate and says so (FAILED_PRECONDITION: the scheduler recomputes)."""
    ca = certs.CertificateAuthority(1)
    files = {"ca.crt": ca.issued.cert}
    key = ec.generate_private_key(ec.SECP256R1())  # a leaf without the 127.0.0.1 tools.certs always adds
    named_only = (
        ca._builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefill.test")]), key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("prefill.test")]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    files["prefill.crt"] = named_only.public_bytes(serialization.Encoding.PEM)
    files["prefill.key"] = certs._pem_key(key)
    for name, issued in (("decode", ca.issue("decode", [], server=True)), ("client", ca.issue("client", [], False))):
        files[f"{name}.crt"], files[f"{name}.key"] = issued.cert, issued.key
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)

    def tls(role: str) -> list[str]:
        return ["--tls-cert", str(tmp_path / f"{role}.crt"), "--tls-key", str(tmp_path / f"{role}.key")]

    client_ca = ["--tls-client-ca", str(tmp_path / "ca.crt")]
    prefill = ServiceProcess("worker_svc", [*WORKER, "--kv-role", "prefill", *tls("prefill"), *client_ca])
    decode = ServiceProcess("worker_svc", [*WORKER, "--kv-role", "decode", *tls("decode"), *client_ca])
    credentials = grpc.ssl_channel_credentials(files["ca.crt"], files["client.key"], files["client.crt"])
    options = [("grpc.ssl_target_name_override", "prefill.test")]
    with running([prefill, decode]):
        with (
            grpc.secure_channel(prefill.address, credentials, options=options) as to_prefill,
            grpc.secure_channel(decode.address, credentials) as to_decode,
        ):
            src, dst = (
                worker_pb2_grpc.WorkerStub(c).Info(worker_pb2.InfoRequest(), timeout=30)
                for c in (to_prefill, to_decode)
            )

            def fetch(server_name: str) -> worker_pb2.FetchBlocksResponse:
                request = worker_pb2.FetchBlocksRequest(
                    source=prefill.address,
                    source_instance_id=src.instance_id,
                    instance_id=dst.instance_id,
                    src_block_ids=[3, 4],
                    dst_block_ids=[7, 1],
                    source_tls_server_name=server_name,
                )
                return worker_pb2_grpc.WorkerStub(to_decode).FetchBlocks(request, timeout=60)

            reply = fetch("prefill.test")
            assert (reply.blocks, reply.bytes) == (2, 2 * src.kv_bytes_per_block)
            with pytest.raises(grpc.RpcError) as refused:
                fetch("")  # 127.0.0.1 is not in the prefill worker's certificate
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"reading blocks from {prefill.address}" in refused.value.details()
