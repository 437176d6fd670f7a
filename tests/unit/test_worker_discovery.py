"""--workers dns:///NAME:PORT: parsing and start-up checks, resolution (a stub
resolver, and the real one on localhost), and the real engine following the
answers of a stub resolver against fake workers over gRPC (no torch): start-up
waits for the first worker, a new address joins, a vanished one is drained while
its requests finish, a failed resolution changes nothing, fixed workers stay.
Each discovery round is driven by the test (`reconcile()`), never by a clock."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import serving_pb2_grpc, worker_pb2_grpc
from scheduler_svc.api.server import start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.discovery import WorkerDiscovery
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.errors import StartupError
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.text.tokenizer import load_tokenizer
from svc_common.targets import Resolution, Target, format_address, parse_targets, resolve_dns, resolve_targets
from tests.helpers.aio_generate import generate
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.fake_worker_server import FakeWorkerServicer, audit_engine, slow_down_steps, start_fake_worker
from tests.helpers.stub_dns import StubDns

NAME = "workers.test"
TARGET = f"dns:///{NAME}:50061"


# ---- parsing, checks, resolution -----------------------------------------------------
def test_targets_parse_fixed_and_dns_entries():
    assert parse_targets(f"10.0.0.1:50061, {TARGET},[::1]:7") == [
        Target("10.0.0.1", 50061),
        Target(NAME, 50061, dns=True),
        Target("[::1]", 7),
    ]
    assert str(Target(NAME, 50061, dns=True)) == TARGET
    assert format_address("fd00::5", 50061) == "[fd00::5]:50061" and format_address("10.1.2.3", 1) == "10.1.2.3:1"
    for bad in ("dns:///workers", "dns://8.8.8.8/workers:1", "dns:workers:1", "workers", "dns:///w:0"):
        with pytest.raises(ValueError, match="must be"):
            parse_targets(bad)


@pytest.mark.parametrize(
    ("workers", "interval", "flag"),
    [
        ("dns:///workers", 10.0, "--workers"),
        ("dns://10.0.0.10/workers.test:50061", 10.0, "--workers"),
        ("127.0.0.1:1,dns:///w", 10.0, "--workers"),
        ("", 10.0, "--workers"),
        (TARGET, 0.0, "--worker-discovery-interval-s"),
    ],
)
def test_config_checks_name_the_flag(workers, interval, flag):
    config = SchedulerConfig(workers=workers, worker_discovery_interval_s=interval, model=str(tiny_checkpoint("llama")))
    with pytest.raises(ValueError, match=flag):
        config.validate()


def test_config_takes_fixed_and_dns_workers():
    config = SchedulerConfig(workers=f"127.0.0.1:50061,{TARGET}", model=str(tiny_checkpoint("llama")))
    config.validate()
    assert config.worker_targets == [Target("127.0.0.1", 50061), Target(NAME, 50061, dns=True)]


def test_the_real_resolver_answers_for_localhost():
    found = asyncio.run(resolve_dns("localhost", 50061))
    assert "127.0.0.1:50061" in found or "[::1]:50061" in found
    assert all(a.endswith(":50061") for a in found)


def test_a_failed_resolution_is_reported_not_raised():
    dns = StubDns("10.0.0.1:50061", "10.0.0.2:50061")
    fixed, named = parse_targets(f"10.9.9.9:1,{TARGET}")

    async def scenario():
        first = await resolve_targets([fixed, named], dns)
        assert first.peers == {"10.9.9.9:1": fixed, "10.0.0.1:50061": named, "10.0.0.2:50061": named}
        assert first.failed == []
        dns.fail = True
        assert await resolve_targets([fixed, named], dns) == Resolution({"10.9.9.9:1": fixed}, [named])
        dns.fail, dns.answer = False, []
        assert await resolve_targets([fixed, named], dns) == Resolution({"10.9.9.9:1": fixed}, [])  # empty: an answer

    asyncio.run(scenario())
    assert dns.queries == [(NAME, 50061)] * 3


# ---- the engine following the stub ----------------------------------------------------
STEP_DELAY_S = 0.005


@pytest.fixture(autouse=True)
def slow_steps(monkeypatch):
    """Each fake step takes a little time, so requests are still running when the answer changes."""
    slow_down_steps(monkeypatch, STEP_DELAY_S)


def run(scenario, workers: str = TARGET, num_fake: int = 3, answer: int = 1, **config):
    """scenario(engine, discovery, dns, addresses, stub): `num_fake` fake workers, the stub
    answering with the first `answer` of them, the engine over `workers`."""
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    async def main():
        started = [await start_fake_worker(num_blocks=64, vocab_size=tokenizer.vocab_size) for _ in range(num_fake)]
        addresses = [address for _, address, _ in started]
        dns = StubDns(*addresses[:answer])
        cfg = SchedulerConfig(workers=workers.format(*addresses), worker_discovery_interval_s=0.05, **config)
        engine = await Engine.connect(cfg, tokenizer, resolver=dns)
        discovery = WorkerDiscovery(engine.fleet, cfg.worker_targets, cfg.worker_discovery_interval_s, resolver=dns)
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = serving_pb2_grpc.SchedulerStub(channel)
                await asyncio.wait_for(scenario(engine, discovery, dns, addresses, stub), 60)
        finally:
            await discovery.stop()
            await server.stop(None)
            await engine.stop()
            for s, _, _ in started:
                await s.stop(None)
        audit_engine(engine)

    asyncio.run(asyncio.wait_for(main(), 120))


def states(engine) -> dict[str, WorkerState]:
    return {w.address: w.state for w in engine.fleet.list_workers()}


async def until(predicate, what: str) -> None:
    while not predicate():  # bounded by run()'s wait_for
        await asyncio.sleep(0.005)


def test_workers_join_and_leave_with_the_answer():
    async def scenario(engine, discovery, dns, addresses, stub):
        a, b, c = addresses
        assert states(engine) == {a: WorkerState.SERVING} and discovery.managed == {a}
        await discovery.reconcile()  # same answer: nothing changes
        assert states(engine) == {a: WorkerState.SERVING}

        # b appears: it joins in the next round and, cold and idle, takes the next new prompt.
        busy = asyncio.create_task(generate(stub, [5, 9, 11, 13], 60))
        await until(lambda: engine.fleet.list_workers()[0].running > 0, "a to run")
        dns.answer = [a, b]
        await discovery.reconcile()
        assert states(engine) == {a: WorkerState.SERVING, b: WorkerState.SERVING} and discovery.managed == {a, b}
        assert (await generate(stub, [7, 8, 9], 4)).usage.completion_tokens == 4
        routed = {w.address: w.requests_routed for w in engine.fleet.list_workers()}
        assert routed == {a: 1, b: 1}

        # a vanishes while it runs a request: drained (no new request), the request finishes there.
        dns.answer = [b, c]
        await discovery.reconcile()
        assert states(engine) == {a: WorkerState.DRAINING, b: WorkerState.SERVING, c: WorkerState.SERVING}
        late = await asyncio.gather(*(generate(stub, [20 + i, 21, 22], 3) for i in range(4)))
        assert all(r.usage.completion_tokens == 3 for r in late)
        assert (await busy).usage.completion_tokens == 60
        await until(lambda: a not in states(engine), "a to be removed")
        assert a not in engine.fleet.router.counters
        await discovery.reconcile()
        assert states(engine) == {b: WorkerState.SERVING, c: WorkerState.SERVING} and discovery.managed == {b, c}

        # It comes back: a new worker to the engine, cold.
        dns.answer = [a, b, c]
        await discovery.reconcile()
        assert states(engine)[a] is WorkerState.SERVING and engine.fleet.list_workers()[-1].requests_routed == 0

    run(scenario)


def test_dns_outage_keeps_workers_and_empty_answer_drains_even_the_last():
    async def scenario(engine, discovery, dns, addresses, stub):
        a = addresses[0]
        dns.fail = True
        await discovery.reconcile()
        assert states(engine) == {a: WorkerState.SERVING}
        dns.fail, dns.answer = False, []
        await discovery.reconcile()
        await until(lambda: not engine.fleet.list_workers(), "a to be removed")
        assert not engine.accepting
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, [5, 6, 7], 3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        dns.answer = [a]  # the same worker again (its instance id is unchanged: the prefix index starts empty anyway)
        await discovery.reconcile()
        assert (await generate(stub, [5, 6, 7], 3)).usage.completion_tokens == 3

    run(scenario)


def test_fixed_workers_stay_and_unreachable_peers_are_retried():
    async def scenario(engine, discovery, dns, addresses, stub):
        a, b = addresses
        assert states(engine) == {a: WorkerState.SERVING} and discovery.managed == set()
        dns.answer = ["127.0.0.1:1", b]  # nothing listens on port 1
        await discovery.reconcile()
        assert states(engine) == {a: WorkerState.SERVING, b: WorkerState.SERVING} and discovery.managed == {b}
        dns.answer = []
        await discovery.reconcile()
        await until(lambda: len(engine.fleet.list_workers()) == 1, "b to be removed")
        assert states(engine) == {a: WorkerState.SERVING}  # fixed: never drained by discovery

    run(scenario, workers="{0}," + TARGET, num_fake=2, answer=0, connect_timeout_s=0.2)


def test_start_up_waits_for_the_first_worker_in_dns():
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    class LateDns(StubDns):
        async def __call__(self, name, port):
            answer = await super().__call__(name, port)
            return answer if len(self.queries) >= 3 else []

    async def main():
        server, address, _ = await start_fake_worker(num_blocks=64, vocab_size=tokenizer.vocab_size)
        try:
            dns = LateDns(address)
            config = SchedulerConfig(workers=TARGET, worker_discovery_interval_s=0.01, connect_timeout_s=60)
            engine = await Engine.connect(config, tokenizer, resolver=dns)
            assert [c.info.address for c in engine.cores] == [address] and len(dns.queries) == 3
            await engine.stop()
            config.connect_timeout_s = 0.1
            with pytest.raises(StartupError, match=rf"--workers: no worker of {TARGET} answered within 0.1s"):
                await Engine.connect(config, tokenizer, resolver=StubDns())
            with pytest.raises(StartupError, match="resolved to 127.0.0.1:1"):
                await Engine.connect(config, tokenizer, resolver=StubDns("127.0.0.1:1"))
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_worker_found_through_dns_is_checked_against_the_name_not_its_ip(tmp_path):
    """TLS to workers: a discovered worker is dialled by IP, and its certificate names
    the DNS name (as a Kubernetes worker's names its headless Service)."""
    ca_pem, cert_pem, key_pem = _throwaway_pki(tmp_path, NAME)
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    async def main():
        server = grpc.aio.server()
        servicer = FakeWorkerServicer(64, tokenizer.vocab_size)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        credentials = grpc.ssl_server_credentials([(key_pem.read_bytes(), cert_pem.read_bytes())])
        address = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
        await server.start()
        try:
            config = SchedulerConfig(workers=TARGET, worker_tls_ca=str(ca_pem), connect_timeout_s=5)
            engine = await Engine.connect(config, tokenizer, resolver=StubDns(address))
            assert [c.info.address for c in engine.cores] == [address]
            await engine.stop()
            # The same worker as a fixed address: dialled and checked as 127.0.0.1, which it is not named.
            with pytest.raises(StartupError, match="did not answer"):
                await Engine.connect(
                    SchedulerConfig(workers=address, worker_tls_ca=str(ca_pem), connect_timeout_s=1), tokenizer
                )
        finally:
            await server.stop(None)

    asyncio.run(asyncio.wait_for(main(), 60))


def _throwaway_pki(directory, dns_name: str):
    """A CA, and a server certificate for `dns_name` only (no IP address) that it signed."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def build(subject: str, issuer: str, public_key, signer, *extensions):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = build(
        "test-ca", "test-ca", ca_key.public_key(), ca_key, (x509.BasicConstraints(ca=True, path_length=None), True)
    )
    cert = build(
        dns_name, "test-ca", key.public_key(), ca_key, (x509.SubjectAlternativeName([x509.DNSName(dns_name)]), False)
    )
    paths = directory / "ca.crt", directory / "worker.crt", directory / "worker.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths
