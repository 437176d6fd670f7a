"""The gateway over several schedulers: routing keys from the model's tokenizer,
the consistent-hash ring and its load bound (pure), and SchedulerPool against
in-process fake serving.v1 schedulers over gRPC (no model, no torch): equal
prefixes go to one scheduler, an unhealthy or vanished scheduler is routed
around, DNS membership is followed, and the HTTP app answers over a pool."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tokenizers import Tokenizer

from gateway_svc.config import GatewayConfig
from gateway_svc.prefix_routing import HashRing, PrefixKeys, choose, least_loaded
from gateway_svc.scheduler_pool import SchedulerPool
from gateway_svc.server import GatewayServer
from proto import serving_pb2, serving_pb2_grpc
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.stub_dns import StubDns

MODEL = tiny_checkpoint("llama")
TOKENIZER = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
WAIT_S = 10.0


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 700) for _ in range(n)]


# ---- keys, ring, bound (pure) --------------------------------------------------------
def test_the_key_is_the_salt_and_the_first_tokens():
    keys = PrefixKeys(TOKENIZER, 32)
    shared = ids(1, 32)
    key = keys.key("", shared + ids(2, 9))
    assert key is not None and key == keys.key("", shared + ids(3, 40))  # only the first 32 tokens count
    assert keys.key("", ids(4, 1) + shared[1:] + ids(2, 9)) != key
    assert keys.key("", shared + ids(2, 9), cache_salt="tenant-a") != key  # salted caches never share blocks
    assert keys.key("", shared) is None  # <= 32 tokens: at most one block to share, no key
    text = "The quick brown fox jumps over the lazy dog. " * 8
    encoded = TOKENIZER.encode(text, add_special_tokens=True).ids
    assert len(encoded) > 33 and keys.key(text, []) == keys.key("", encoded)
    long_text = text + "and then some more words " * 2000  # only its head is tokenized
    assert keys.key(long_text, []) == key_of(TOKENIZER.encode(long_text, add_special_tokens=True).ids[:32])
    assert PrefixKeys(None, 32).key(text, []) is None


def key_of(prefix: list[int], salt: str = "") -> bytes:
    digest = hashlib.sha256(salt.encode() + b"\0")
    digest.update(b"".join(i.to_bytes(4, "little", signed=True) for i in prefix))
    return digest.digest()


def test_the_ring_is_balanced_and_moves_only_the_keys_of_a_member_that_leaves():
    members = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    ring, smaller = HashRing(members), HashRing(members[:2])
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(3000)]
    orders = [ring.order(k) for k in keys]
    assert all(sorted(o) == members for o in orders)
    firsts = [o[0] for o in orders]
    assert all(0.25 < firsts.count(m) / len(keys) < 0.42 for m in members)
    for key, order in zip(keys, orders):
        expected = [m for m in order if m != members[2]]
        assert smaller.order(key) == expected  # the others keep their keys; the leaver's go to their next


def test_the_load_bound_spills_a_hot_key_to_the_next_on_its_ring():
    order = ["a", "b", "c"]
    # capacity: ceil(1.25 x (in flight + this one) / 3); a member takes it if its load + 1 fits
    assert choose(order, {"a": 0, "b": 0, "c": 0}, 1.25) == "a"  # cap 1
    assert choose(order, {"a": 1, "b": 0, "c": 0}, 1.25) == "b"  # cap 1: a is full
    assert choose(order, {"a": 2, "b": 1, "c": 0}, 1.25) == "b"  # cap 2
    assert choose(order, {"a": 2, "b": 2, "c": 0}, 1.25) == "a"  # cap 3
    assert choose(order, {"a": 3, "b": 3, "c": 0}, 1.25) == "c"  # cap 3: a and b are full
    assert choose(order, {"a": 5, "b": 5, "c": 5}, 1.25) == "a"  # cap 7
    assert choose(order, {"a": 9, "b": 0, "c": 0}, 100.0) == "a"  # a loose bound: affinity wins
    # An absolute slack: up to the average (rounded up) + slack, whatever the factor.
    assert choose(order, {"a": 6, "b": 0, "c": 0}, 1.25, slack=4) == "a"  # cap max(3, 3 + 4) = 7
    assert choose(order, {"a": 7, "b": 0, "c": 0}, 1.25, slack=4) == "b"  # cap max(4, 3 + 4) = 7: a is full
    assert least_loaded(order, {"a": 3, "b": 1, "c": 2}) == "b"
    assert {least_loaded(order, {"a": 1, "b": 1, "c": 1}, random.Random(s)) for s in range(20)} == set(order)


# ---- the pool against fake schedulers ------------------------------------------------
class FakeScheduler(serving_pb2_grpc.SchedulerServicer):
    """Streams its name as the text; `hold` keeps calls open until set."""

    def __init__(self, name: str):
        self.name = name
        self.requests: list[serving_pb2.GenerateRequest] = []
        self.hold: asyncio.Event | None = None

    async def Generate(self, request, context):
        self.requests.append(request)
        if self.hold is not None:
            await self.hold.wait()
        yield serving_pb2.GenerateResponse(text=self.name, token_ids=[1])
        usage = serving_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=1)
        yield serving_pb2.GenerateResponse(finished=True, finish_reason="length", usage=usage)


@contextlib.asynccontextmanager
async def fake_schedulers(count: int):
    started = []
    for i in range(count):
        server, servicer, health_servicer = grpc.aio.server(), FakeScheduler(f"s{i}"), health.aio.HealthServicer()
        serving_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        servicer.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        servicer.health, servicer.server = health_servicer, server
        await server.start()
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        started.append(servicer)
    try:
        yield started
    finally:
        for s in started:
            await s.server.stop(None)


def pool_config(schedulers: str, **overrides) -> GatewayConfig:
    config = GatewayConfig(schedulers=schedulers, model_dir=str(MODEL), scheduler_health_interval_s=3600, **overrides)
    config.validate()
    return config


async def complete(pool: SchedulerPool, prompt_ids: list[int]) -> str:
    request = serving_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=1)
    return "".join([m.text async for m in pool.generate(request, None)])


def by_owner(pool: SchedulerPool, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """The prompts grouped by the scheduler first on their key's ring order."""
    owners: dict[str, list[list[int]]] = {}
    for p in prompts:
        owners.setdefault(pool._ring.order(pool.keys.key("", p))[0], []).append(p)
    return owners


def test_equal_prefixes_go_to_one_scheduler_and_others_spread():
    async def scenario():
        async with fake_schedulers(2) as (s0, s1):
            pool = await SchedulerPool.open(pool_config(f"{s0.address},{s1.address}"))
            try:
                systems = [ids(100 + g, 40) for g in range(12)]
                for g, system in enumerate(systems):
                    texts = {await complete(pool, system + ids(1000 * g + i, 5)) for i in range(4)}
                    assert len(texts) == 1, f"prefix {g} went to {texts}"  # one scheduler per prefix
                owners = by_owner(pool, systems)
                assert len(s0.requests) == 4 * len(owners[s0.address])
                assert len(s1.requests) == 4 * len(owners[s1.address]) > 0 and s0.requests
                # A short prompt has no key: the least loaded takes it (both idle: either).
                assert await complete(pool, ids(7, 20)) in ("s0", "s1")
            finally:
                await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_hot_prefix_fills_its_scheduler_up_to_the_bound_then_spills_over():
    async def scenario():
        async with fake_schedulers(2) as (s0, s1):
            pool = await SchedulerPool.open(pool_config(f"{s0.address},{s1.address}", routing_load_slack=0))
            hold = asyncio.Event()
            s0.hold = s1.hold = hold
            try:
                prompt = ids(5, 40)
                first, second = pool._ring.order(pool.keys.key("", prompt))
                calls = [pool.generate(serving_pb2.GenerateRequest(prompt_token_ids=prompt), None) for _ in range(4)]
                # caps: ceil(1.25 * n / 2) for n = 1..4 -> 1, 2, 2, 3: the third goes to the next on the ring
                assert pool._members[first].in_flight == 3 and pool._members[second].in_flight == 1
                readers = [asyncio.create_task(collect(c)) for c in calls]
                hold.set()
                texts = await asyncio.gather(*readers)
                names = {s.address: s.name for s in (s0, s1)}
                assert sorted(texts) == sorted([names[first]] * 3 + [names[second]])
                assert all(m.in_flight == 0 for m in pool._members.values())
            finally:
                hold.set()
                await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


async def collect(call) -> str:
    return "".join([m.text async for m in call])


def test_unhealthy_and_stopped_schedulers_are_routed_around():
    async def scenario():
        async with fake_schedulers(2) as (s0, s1):
            pool = await SchedulerPool.open(pool_config(f"{s0.address},{s1.address}"))
            try:
                owners = by_owner(pool, [ids(200 + g, 40) for g in range(16)])
                prompt = owners[s0.address][0]  # a prefix s0 owns
                assert await complete(pool, prompt) == "s0"
                await s0.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await pool.check_members()
                assert pool.members == {s0.address: False, s1.address: True}
                assert await complete(pool, prompt) == "s1"
                assert await pool.check_health() == (True, "")
                await s0.health.set("", health_pb2.HealthCheckResponse.SERVING)
                await pool.check_members()
                assert await complete(pool, prompt) == "s0"  # back: its keys come back to it

                # Stopped without a health check noticing: the call fails before any
                # output, s0 is marked down and s1 answers instead.
                await s0.server.stop(None)
                assert await complete(pool, prompt) == "s1"
                assert pool.members == {s0.address: False, s1.address: True}
                assert len(s0.requests) == 2

                await s1.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                serving, why = await pool.check_health()
                assert not serving and s0.address in why and s1.address in why and "NOT_SERVING" in why
            finally:
                await pool.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_dns_membership_is_followed():
    async def scenario():
        async with fake_schedulers(2) as (s0, s1):
            dns = StubDns(s0.address)
            pool = await SchedulerPool.open(pool_config("dns:///schedulers.test:50051"), resolver=dns)
            try:
                assert pool.members == {s0.address: True}
                dns.answer = [s0.address, s1.address]
                await pool.refresh_members()
                assert pool.members == {s0.address: True, s1.address: True}
                dns.fail = True
                await pool.refresh_members()
                assert set(pool.members) == {s0.address, s1.address}  # an outage removes nobody
                dns.fail = False
                s0.hold = s1.hold = asyncio.Event()
                held = pool.generate(serving_pb2.GenerateRequest(prompt_token_ids=ids(9, 10)), None)
                reader = asyncio.create_task(collect(held))
                while not s0.requests and not s1.requests:
                    await asyncio.sleep(0.005)
                leaving = s0.address if s0.requests else s1.address
                dns.answer = [a for a in (s0.address, s1.address) if a != leaving]
                await pool.refresh_members()
                assert set(pool.members) == set(dns.answer)
                assert [m.address for m in pool._leaving] == [leaving]  # its stream goes on
                s0.hold.set()
                assert await reader in ("s0", "s1")
                await pool.refresh_members()
                assert pool._leaving == []  # closed once idle
                dns.answer = []
                await pool.refresh_members()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await complete(pool, ids(3, 40))
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                await pool.close()
            assert dns.queries and set(dns.queries) == {("schedulers.test", 50051)}

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_http_gateway_over_a_pool():
    async def scenario():
        async with fake_schedulers(2) as (s0, s1):
            config = pool_config(f"{s0.address},{s1.address}", host="127.0.0.1", port=0, log_level="warning")
            server = GatewayServer(config)
            serving = asyncio.create_task(server.serve())
            try:
                while not server.ready.is_set():
                    await asyncio.sleep(0.01)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as http:
                    body = {"prompt": ids(11, 40), "max_tokens": 1, "n": 2}
                    reply = (await http.post("/v1/completions", json=body)).json()
                    texts = {c["text"] for c in reply["choices"]}
                    assert len(texts) == 1 and texts <= {"s0", "s1"}  # both samples: the prefix's scheduler
                    assert (await http.get("/health")).json() == {"status": "ok"}
                    for s in (s0, s1):
                        await s.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                    r = await http.get("/health")
                    assert r.status_code == 503 and s0.address in r.json()["detail"]
            finally:
                server.stop()
                await asyncio.wait_for(serving, WAIT_S)

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        ({"schedulers": "127.0.0.1:1,dns:///x"}, "--schedulers"),
        ({"schedulers": "127.0.0.1:1", "model_dir": ""}, "--model-dir"),
        ({"schedulers": "127.0.0.1:1", "routing_load_factor": 0.9}, "--routing-load-factor"),
        ({"schedulers": "127.0.0.1:1", "routing_prefix_tokens": 0}, "--routing-prefix-tokens"),
        ({"schedulers": "127.0.0.1:1", "scheduler_health_interval_s": 0}, "--scheduler-health-interval-s"),
    ],
)
def test_config_checks_name_the_flag(overrides, flag):
    config = GatewayConfig(**{"model_dir": str(MODEL), **overrides})
    with pytest.raises(ValueError, match=flag):
        config.validate()


def test_least_loaded_and_random_need_no_tokenizer():
    for routing in ("least-loaded", "random"):
        GatewayConfig(schedulers="127.0.0.1:1", model_dir="", scheduler_routing=routing).validate()
