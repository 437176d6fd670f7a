"""Security with real processes and throwaway certificates: both services bind
127.0.0.1 by default; TLS on the client API; mutual TLS between scheduler and
worker; API keys on the scheduler (health stays open). Every check that a
client without the right credentials is refused is a real gRPC call."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import serving_pb2, serving_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.api.auth import bearer_token, load_api_keys
from scheduler_svc.config import SchedulerConfig
from svc_common.cli import parse_config
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.procs import REPO, ServiceProcess
from worker_svc.config import WorkerConfig

MODEL = tiny_checkpoint("llama")
ENV_KEYS = ("env-key-1", "env-key-2")
FILE_KEY = "file-key-3"


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
    rogue_client: Pem
    keys_file: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CertificateAuthority(d, "test-ca"), CertificateAuthority(d, "rogue-ca")
    keys_file = d / "api_keys"
    keys_file.write_text(f"# one key per line\n\n{FILE_KEY}\n")
    return Pki(
        ca,
        rogue,
        ca.issue("worker", server=True),
        ca.issue("scheduler", server=True),
        ca.issue("scheduler-client", server=False),
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
    ],
)
def test_bad_tls_flags_are_clear_errors_naming_the_flag(pki, module, args, flag):
    args = [a.format(cert=pki.worker.cert, key=pki.worker.key) for a in args]
    result = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and flag in result.stderr, result.stderr[-2000:]


def test_api_key_parsing(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# comment\n  spaced-key  \n\nsecond\n")
    assert load_api_keys(" a , b,,", str(keys_file)) == {"a", "b", "spaced-key", "second"}
    assert load_api_keys() == frozenset()
    assert bearer_token((("authorization", "bearer abc"),)) == "abc"
    assert bearer_token((("authorization", "Token abc"),)) is None
    assert bearer_token(()) is None
