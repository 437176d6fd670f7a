"""Security with real processes and throwaway certificates: both services bind
127.0.0.1 by default; TLS on the client API; mutual TLS between scheduler and
worker; API keys on the scheduler (health stays open); the internal token
between scheduler and worker; admin keys on admin.v1 (issue 29). Every check
that a client without the right credentials is refused is a real gRPC call."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import admin_pb2, admin_pb2_grpc, serving_pb2, serving_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.config import SchedulerConfig
from svc_common.cli import parse_config
from svc_common.peer_auth import bearer_token, load_keys
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO, Cluster, ServiceProcess
from tests.helpers.worker_client import seq_step, step_request
from worker_svc.config import WorkerConfig

MODEL = tiny_checkpoint("llama")
ENV_KEYS = ("env-key-1", "env-key-2")
FILE_KEY = "file-key-3"
ADMIN_KEY = "admin-key-of-the-secure-cell"


# ---- throwaway PKI --------------------------------------------------------------
@dataclass
class Pem:
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(directory: Path, stem: str, key, cert: x509.Certificate) -> Pem:
    pem = Pem(directory / f"{stem}.crt", directory / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pem


class CertificateAuthority:
    def __init__(self, directory: Path, name: str):
        self.directory = directory
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = _write(directory, name, self.key, self.cert)

    def issue(self, name: str, server: bool) -> Pem:
        """A leaf for 127.0.0.1/localhost: a server certificate, or a client one."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return _write(self.directory, name, key, cert)


@dataclass
class Pki:
    ca: CertificateAuthority
    rogue: CertificateAuthority  # a CA nobody trusts
    worker: Pem
    scheduler: Pem
    scheduler_client: Pem  # what the scheduler presents to workers
    other_client: Pem  # another service's client certificate from the same CA
    rogue_client: Pem
    keys_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(d, "test-ca"), CertificateAuthority(d, "rogue-ca")
    keys_file = d / "api_keys"
    keys_file.write_text(f"# one key per line\n\n{FILE_KEY}\n")
    (d / "admin_keys").write_text(f"{ADMIN_KEY}\n")
    return Pki(
        ca,
        rogue,
        ca.issue("worker", server=True),
        ca.issue("scheduler", server=True),
        ca.issue("scheduler-client", server=False),
        ca.issue("some-other-service", server=False),
        rogue.issue("intruder", server=False),
        keys_file,
    )


@pytest.fixture(scope="module")
def secure(pki):
    """A worker that demands client certificates from test-ca, and a scheduler with
    TLS on its API, API keys (env + file), and mutual TLS to the worker."""
    worker = ServiceProcess(
        "worker_svc",
        [
            "--model",
            str(MODEL),
            "--dtype",
            "float32",
            "--num-blocks",
            "64",
            "--tls-cert",
            str(pki.worker.cert),
            "--tls-key",
            str(pki.worker.key),
            "--tls-client-ca",
            str(pki.ca.pem.cert),
            "--tls-client-names",
            "scheduler-client",
        ],
    )
    scheduler = ServiceProcess(
        "scheduler_svc",
        [
            "--model",
            str(MODEL),
            "--tls-cert",
            str(pki.scheduler.cert),
            "--tls-key",
            str(pki.scheduler.key),
            "--api-keys-file",
            str(pki.keys_file),
            "--admin-keys-file",
            str(pki.keys_file.parent / "admin_keys"),
            "--worker-tls-ca",
            str(pki.ca.pem.cert),
            "--worker-tls-cert",
            str(pki.scheduler_client.cert),
            "--worker-tls-key",
            str(pki.scheduler_client.key),
        ],
        env={"PAGEDSERVE_SCHEDULER_API_KEYS": ",".join(ENV_KEYS)},
    )
    with worker:
        scheduler.args += ["--workers", worker.address]
        with scheduler:
            yield worker, scheduler


def tls_channel(address: str, ca: Path, client: Pem | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    return grpc.secure_channel(address, creds)


def generate(channel: grpc.Channel, metadata=None) -> list[serving_pb2.GenerateResponse]:
    request = serving_pb2.GenerateRequest(prompt="hello", max_tokens=3, temperature=0.0, ignore_eos=True)
    return list(serving_pb2_grpc.SchedulerStub(channel).Generate(request, metadata=metadata, timeout=30))


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


# ---- defaults -----------------------------------------------------------------
def test_both_services_bind_loopback_by_default():
    assert parse_config(SchedulerConfig, "PAGEDSERVE_SCHEDULER", "", []).host == "127.0.0.1"
    assert parse_config(WorkerConfig, "PAGEDSERVE_WORKER", "", []).host == "127.0.0.1"


# ---- the client API: TLS + API keys ---------------------------------------------
@pytest.mark.parametrize("key", [*ENV_KEYS, FILE_KEY])
def test_tls_client_with_a_valid_key_is_served_through_mutual_tls_to_the_worker(secure, pki, key):
    _, scheduler = secure
    with tls_channel(scheduler.address, pki.ca.pem.cert) as channel:
        replies = generate(channel, bearer(key))
        stats = serving_pb2_grpc.SchedulerStub(channel).Stats(serving_pb2.StatsRequest(), metadata=bearer(key))
    assert replies[-1].finished and replies[-1].usage.completion_tokens == 3
    assert stats.num_workers == 1


@pytest.mark.parametrize(
    "metadata",
    [
        None,
        bearer("not-a-key"),
        bearer(ENV_KEYS[0] + "x"),
        (("authorization", f"Basic {ENV_KEYS[0]}"),),
        (("authorization", "Bearer "),),
        (("x-api-key", ENV_KEYS[0]),),
    ],
    ids=["no key", "wrong key", "key prefix", "basic scheme", "empty bearer", "other header"],
)
def test_missing_or_wrong_api_key_is_unauthenticated(secure, pki, metadata):
    _, scheduler = secure
    with tls_channel(scheduler.address, pki.ca.pem.cert) as channel:
        assert refused(lambda: generate(channel, metadata)) == grpc.StatusCode.UNAUTHENTICATED
        stub = serving_pb2_grpc.SchedulerStub(channel)
        assert (
            refused(lambda: stub.Stats(serving_pb2.StatsRequest(), metadata=metadata, timeout=10))
            == grpc.StatusCode.UNAUTHENTICATED
        )


def test_unauthenticated_payload_is_not_even_parsed(secure, pki):
    _, scheduler = secure
    garbage = b"\x4a\x02\xff\xfe"  # stop = invalid UTF-8: a parse error if it were parsed
    with tls_channel(scheduler.address, pki.ca.pem.cert) as channel:
        call = channel.unary_stream(
            "/serving.v1.Scheduler/Generate",
            request_serializer=lambda b: b,
            response_deserializer=serving_pb2.GenerateResponse.FromString,
        )
        assert refused(lambda: list(call(garbage, timeout=10))) == grpc.StatusCode.UNAUTHENTICATED


def test_health_stays_open_without_a_key(secure, pki):
    _, scheduler = secure
    with tls_channel(scheduler.address, pki.ca.pem.cert) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_client_is_refused_by_the_tls_api(secure):
    _, scheduler = secure
    with grpc.insecure_channel(scheduler.address) as channel:
        assert refused(lambda: generate(channel, bearer(ENV_KEYS[0]))) == grpc.StatusCode.UNAVAILABLE


def test_client_that_does_not_trust_the_server_certificate_refuses_it(secure, pki):
    _, scheduler = secure
    with tls_channel(scheduler.address, pki.rogue.pem.cert) as channel:
        assert refused(lambda: generate(channel, bearer(ENV_KEYS[0]))) == grpc.StatusCode.UNAVAILABLE


# ---- the worker: mutual TLS -------------------------------------------------------
def _info(channel: grpc.Channel):
    return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)


def test_worker_serves_a_client_with_a_certificate_from_its_ca(secure, pki):
    worker, _ = secure
    with tls_channel(worker.address, pki.ca.pem.cert, pki.scheduler_client) as channel:
        assert _info(channel).model_type == "llama"


@pytest.mark.parametrize("case", ["plaintext", "no client certificate", "certificate from another CA"])
def test_worker_refuses_clients_without_the_right_certificate(secure, pki, case):
    worker, _ = secure
    channel = {
        "plaintext": lambda: grpc.insecure_channel(worker.address),
        "no client certificate": lambda: tls_channel(worker.address, pki.ca.pem.cert),
        "certificate from another CA": lambda: tls_channel(worker.address, pki.ca.pem.cert, pki.rogue_client),
    }[case]()
    with channel:
        assert refused(lambda: _info(channel)) == grpc.StatusCode.UNAVAILABLE


def test_worker_takes_steps_only_from_its_schedulers_certificate(secure, pki):
    """--tls-client-names: another service's certificate from the same CA passes the
    handshake (health answers) but may not call the worker."""
    worker, _ = secure
    with tls_channel(worker.address, pki.ca.pem.cert, pki.other_client) as channel:
        assert refused(lambda: _info(channel)) == grpc.StatusCode.PERMISSION_DENIED
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert refused(lambda: stub.Step(worker_pb2.StepRequest(step_id=1), timeout=10)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_scheduler_without_a_client_certificate_cannot_use_the_worker(secure, pki):
    worker, _ = secure
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "scheduler_svc",
            "--model",
            str(MODEL),
            "--workers",
            worker.address,
            "--port",
            "0",
            "--worker-tls-ca",
            str(pki.ca.pem.cert),
            "--connect-timeout-s",
            "2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "start-up failed" in result.stderr and worker.address in result.stderr


# ---- configuration errors -----------------------------------------------------------
@pytest.mark.parametrize(
    "module,args,flag",
    [
        ("scheduler_svc", ["--tls-cert", "{cert}"], "--tls-cert"),
        ("scheduler_svc", ["--tls-cert", "/nonexistent.crt", "--tls-key", "{key}"], "--tls-cert"),
        ("scheduler_svc", ["--api-keys-file", "/nonexistent"], "--api-keys-file"),
        ("scheduler_svc", ["--worker-tls-cert", "{cert}", "--worker-tls-key", "{key}"], "--worker-tls-cert"),
        ("worker_svc", ["--tls-client-ca", "{cert}"], "--tls-client-ca"),
        ("worker_svc", ["--tls-key", "{key}"], "--tls-cert"),
        ("worker_svc", ["--tls-client-names", "scheduler"], "--tls-client-names"),
    ],
)
def test_bad_tls_flags_are_clear_errors_naming_the_flag(pki, module, args, flag):
    args = [a.format(cert=pki.worker.cert, key=pki.worker.key) for a in args]
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and flag in result.stderr, result.stderr[-2000:]


def test_api_key_parsing(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n  spaced-key  \n\nsecond\n")
    assert load_keys(" a , b,,", str(keys_file)) == {"a", "b", "spaced-key", "second"}
    assert load_keys() == frozenset()
    assert bearer_token((("authorization", "bearer abc"),)) == "abc"
    assert bearer_token((("authorization", "Token abc"),)) is None
    assert bearer_token(()) is None


# ---- the control plane of a keyed cell (issue 29, items 1 and 2) ----------------------------
# A cell as `make serve` starts one: the workers take steps only from the scheduler (the
# internal token the launcher made), admin.v1 needs the launcher's admin key, clients an API key.
CELL_BLOCKS = 64
CLIENT_KEY = "client-key-of-the-keyed-cell"


@pytest.fixture(scope="module")
def keyed_cell(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{CLIENT_KEY}\n")
    with Cluster(
        MODEL,
        worker_args=["--dtype", "float32", "--num-blocks", str(CELL_BLOCKS)],
        scheduler_args=["--api-keys-file", str(keys), "--kv-events-buffer-steps", "64"],
    ) as cluster:
        yield cluster


def victim_answer(cluster: Cluster) -> serving_pb2.GenerateResponse:
    """A keyed, salted tenant's greedy answer (the last message: text in `joined`, usage)."""
    request = serving_pb2.GenerateRequest(
        prompt="Question: what is the answer to every question? " * 4 + "Answer:",
        max_tokens=8,
        temperature=0.0,
        cache_salt="victim",
    )
    with grpc.insecure_channel(cluster.address) as channel:
        replies = list(
            serving_pb2_grpc.SchedulerStub(channel).Generate(request, metadata=bearer(CLIENT_KEY), timeout=60)
        )
    last = replies[-1]
    last.text = "".join(r.text for r in replies)
    return last


def junk_step() -> worker_pb2.StepRequest:
    """One well-formed step that writes token 0 into every slot of every block: what poisoned
    the cache in issue 29 (rows of 16 blocks, within the tiny model's 512-token context)."""
    rows = [
        seq_step(424242 + r, [0] * 256, 0, list(range(16 * r, 16 * (r + 1))), logits=False)
        for r in range(CELL_BLOCKS // 16)
    ]
    return step_request(10**9, rows)


def test_a_step_without_the_internal_token_is_refused_and_the_cache_stays_intact(keyed_cell):
    before = victim_answer(keyed_cell)
    worker = keyed_cell.workers[0]
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        for metadata in (None, bearer("guess-guess-guess-guess"), bearer(CLIENT_KEY), keyed_cell.admin_metadata):
            step = lambda m=metadata: stub.Step(junk_step(), metadata=m, timeout=30)
            assert refused(step) == grpc.StatusCode.UNAUTHENTICATED
            assert refused(lambda m=metadata: _info_with(channel, m)) == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no secret
    after = victim_answer(keyed_cell)
    assert after.usage.cached_prompt_tokens >= 16  # read back from the cache the junk step would have overwritten
    assert after.text == before.text


def _info_with(channel: grpc.Channel, metadata):
    return worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), metadata=metadata, timeout=10)


def test_the_scheduler_presents_the_internal_token(keyed_cell):
    worker = keyed_cell.workers[0]
    token = keyed_cell.secrets.internal_token_file.read_text().strip()
    with grpc.insecure_channel(worker.address) as channel:
        assert _info_with(channel, bearer(token)).num_blocks == CELL_BLOCKS
    assert victim_answer(keyed_cell).usage.completion_tokens == 8  # and the cell serves through it


def admin_calls(stub: admin_pb2_grpc.AdminStub, cell: Cluster, metadata):
    """Every admin.v1 method, each as a call that raises on refusal."""
    worker = cell.workers[0].address
    return {
        "ListWorkers": lambda: stub.ListWorkers(admin_pb2.ListWorkersRequest(), metadata=metadata, timeout=10),
        "DrainWorker": lambda: stub.DrainWorker(
            admin_pb2.DrainWorkerRequest(address=worker, allow_last=True), metadata=metadata, timeout=10
        ),
        "AddWorker": lambda: stub.AddWorker(
            admin_pb2.AddWorkerRequest(address="127.0.0.1:9"), metadata=metadata, timeout=10
        ),
        "SubscribeKvEvents": lambda: next(
            iter(stub.SubscribeKvEvents(admin_pb2.SubscribeKvEventsRequest(), metadata=metadata, timeout=10))
        ),
    }


@pytest.mark.parametrize("who", ["no key", "a client's API key", "a wrong key"])
def test_admin_calls_without_the_admin_key_are_refused(keyed_cell, who):
    metadata = {"no key": None, "a client's API key": bearer(CLIENT_KEY), "a wrong key": bearer("x" * 32)}[who]
    victim_answer(keyed_cell)  # KV events exist to be read
    with grpc.insecure_channel(keyed_cell.scheduler.admin_address) as channel:
        for method, call in admin_calls(admin_pb2_grpc.AdminStub(channel), keyed_cell, metadata).items():
            assert refused(call) == grpc.StatusCode.UNAUTHENTICATED, method
        listed = admin_calls(admin_pb2_grpc.AdminStub(channel), keyed_cell, keyed_cell.admin_metadata)["ListWorkers"]
        assert [w.state for w in listed().workers] == [admin_pb2.WORKER_STATE_SERVING]  # the drain never happened
    assert victim_answer(keyed_cell).finished


def test_the_admin_key_lists_workers_and_reads_kv_events(keyed_cell):
    victim_answer(keyed_cell)
    with grpc.insecure_channel(keyed_cell.scheduler.admin_address) as channel:
        calls = admin_calls(admin_pb2_grpc.AdminStub(channel), keyed_cell, keyed_cell.admin_metadata)
        assert [w.address for w in calls["ListWorkers"]().workers] == [keyed_cell.workers[0].address]
        assert calls["SubscribeKvEvents"]().worker == keyed_cell.workers[0].address
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def run_scheduler(*args: str) -> subprocess.CompletedProcess[str]:
    """The scheduler's own checks of its flags (exit 2 before any worker is dialled)."""
    command = [sys.executable, "-m", "scheduler_svc", "--model", str(MODEL), "--port", "0", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--api-keys", CLIENT_KEY], "--admin-keys-file"),  # keyed clients, open admin: the hole of issue 29
        (["--admin-host", "0.0.0.0"], "--admin-keys-file"),
        (["--api-keys", CLIENT_KEY, "--admin-keys", CLIENT_KEY], "--admin-keys"),  # a client must not administer
        (["--kv-events-zmq", "tcp://*:5557"], "--kv-events-zmq"),
        (["--api-keys", CLIENT_KEY, "--admin-port", "-1", "--kv-events-zmq", "ipc:///tmp/kv"], "--kv-events-zmq"),
        (["--internal-token-file", "/nonexistent"], "--internal-token-file"),
    ],
)
def test_an_open_control_plane_is_refused_at_start(args, flag):
    result = run_scheduler(*args)
    assert result.returncode == 2 and f"{flag}: must be" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--internal-token-file", "{short}"]])
def test_a_worker_beyond_loopback_needs_a_credential(tmp_path, args):
    short = tmp_path / "short.token"
    short.write_text("too-short\n")
    args = [a.format(short=short) for a in args]
    result = subprocess.run(
        [sys.executable, "-m", "worker_svc", "--model", str(MODEL), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--internal-token-file: must be" in result.stderr, result.stderr[-2000:]


# ---- the gateway in front of a TLS scheduler (issue 29, item 7) ----------------------------
def gateway_on(scheduler: ServiceProcess, *args: str) -> ServiceProcess:
    return ServiceProcess("gateway_svc", ["--scheduler", scheduler.address, "--model-dir", str(MODEL), *args])


def test_the_gateway_talks_tls_to_a_tls_scheduler_with_the_same_key_rules(secure, pki):
    _, scheduler = secure
    tls = ["--scheduler-tls-ca", str(pki.ca.pem.cert)]
    client_cert = [
        "--scheduler-tls-cert",
        str(pki.scheduler_client.cert),
        "--scheduler-tls-key",
        str(pki.scheduler_client.key),
    ]
    for args in (tls, tls + client_cert):  # a client certificate is optional
        with (
            gateway_on(scheduler, *args) as gateway,
            httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as http,
        ):
            assert http.get("/health").json() == {"status": "ok"}
            key = {"Authorization": f"Bearer {FILE_KEY}"}
            body = {"prompt": "hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            done = http.post("/v1/completions", json=body, headers=key)
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 3, done.text
            assert http.post("/v1/completions", json=body).status_code == 401
            assert http.get("/v1/models").status_code == 401  # the scheduler's keys hold for /v1/models too
            models = http.get("/v1/models", headers=key)
            assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] > 0


def test_a_plaintext_gateway_cannot_reach_a_tls_scheduler(secure):
    _, scheduler = secure
    with gateway_on(scheduler) as gateway, httpx.Client(base_url=f"http://{gateway.address}", timeout=60) as http:
        assert http.get("/health").status_code == 503
        reply = http.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {FILE_KEY}"})
        assert reply.status_code == 503
