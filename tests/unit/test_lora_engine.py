"""LoRA through the real engine and serving.v1 over gRPC, against fake workers (no
torch): requests of the base and of three adapters mixed in the same steps, each row
naming its adapter's slot (the fake worker's tokens depend on it, and it refuses KV
read across adapters); adapters loaded before the step that needs them, evicted LRU
when slots run out and reloaded; prefix cache never shared across adapters
(cached_tokens); unknown and refused adapters ending requests by name; admin.v1
registering and forgetting adapters at run time; routing to the worker that holds
an adapter."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proto import admin_pb2, serving_pb2, serving_pb2_grpc
from scheduler_svc.api.admin import AdminServicer
from scheduler_svc.api.server import start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.errors import StartupError
from scheduler_svc.observability.collector import EngineCollector
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.fake_worker_server import audit_engine, slow_down_steps, start_fake_worker
from tests.helpers.lora_dirs import adapter_dir

BLOCK = 16
PROMPT = list(range(3, 3 + 2 * BLOCK + 5))  # two full blocks and a partial one


@pytest.fixture(autouse=True)
def slow_steps(monkeypatch):
    slow_down_steps(monkeypatch, 0.003)


def run(tmp_path, scenario, num_workers=1, worker_loras=2, num_blocks=64, **config):
    """scenario(engine, stub, servicers) over fake workers with `worker_loras` slots each,
    the scheduler serving adapters a, b, c (--lora-modules) unless config says otherwise."""
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))
    modules = " ".join(f"{n}={adapter_dir(tmp_path, n, seed=i)}" for i, n in enumerate("abc"))
    config = {"enable_lora": True, "lora_modules": modules, "max_loras": 2, "max_lora_rank": 8} | config

    async def main():
        started = [
            await start_fake_worker(
                num_blocks=num_blocks, vocab_size=tokenizer.vocab_size, max_loras=worker_loras, max_lora_rank=16
            )
            for _ in range(num_workers)
        ]
        addresses = ",".join(address for _, address, _ in started)
        try:
            engine = await Engine.connect(SchedulerConfig(workers=addresses, **config), tokenizer)
        except BaseException:
            for s, _, _ in started:
                await s.stop(None)
            raise
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = serving_pb2_grpc.SchedulerStub(channel)
                await asyncio.wait_for(scenario(engine, stub, [s for _, _, s in started]), 60)
        finally:
            await server.stop(None)
            await engine.stop()
            for s, _, _ in started:
                await s.stop(None)
        audit_engine(engine)

    asyncio.run(asyncio.wait_for(main(), 120))


async def generate(stub, adapter: str, max_tokens: int = 12, prompt=PROMPT) -> serving_pb2.GenerateResponse:
    request = serving_pb2.GenerateRequest(
        prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, lora_adapter=adapter
    )
    replies = [r async for r in stub.Generate(request, timeout=30)]
    assert replies[-1].finished
    tokens = [t for r in replies for t in r.token_ids]
    final = replies[-1]
    final.ClearField("token_ids")
    final.token_ids.extend(tokens)
    return final


def expected(adapter: str, vocab_size: int, max_tokens: int = 12, prompt=PROMPT, model=None) -> list[int]:
    """The fake model's greedy tokens under `adapter` ("" the base), computed directly."""
    fake = FakeWorker(1, vocab_size=vocab_size, model=model)
    if adapter:
        fake.load_adapter(1, adapter)

    class Row:
        seq_id, lora_slot = 0, 1 if adapter else 0

    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(fake.sample(Row(), context, []))
        context.append(out[-1])
    return out


def test_mixed_batch_of_base_and_three_adapters_with_two_slots_evicts_and_reloads_exactly(tmp_path):
    async def scenario(engine, stub, servicers):
        vocab = engine.tokenizer.vocab_size
        names = ["", "a", "b", "c"] * 3
        replies = await asyncio.gather(*(generate(stub, n) for n in names))
        for name, reply in zip(names, replies):
            assert list(reply.token_ids) == expected(name, vocab), name
        assert len({tuple(expected(n, vocab)) for n in "abc" + "_"}) >= 4  # adapters really differ
        slots = engine.cores[0].planner.adapters
        assert slots.loads >= 3 and slots.evictions >= 1  # three adapters through two slots
        assert len(slots.resident) == 2
        loads = servicers[0].adapter_loads
        assert {name for _, name in loads} == {"a", "b", "c"} and {slot for slot, _ in loads} == {1, 2}
        got = scrape(engine)
        w = engine.cores[0].info.address
        assert got[("pagedserve_lora_adapter_loads_total", (("worker", w),))] == slots.loads == len(loads)
        assert got[("pagedserve_lora_adapter_evictions_total", (("worker", w),))] == slots.evictions
        resident = {dict(k)["adapter"]: dict(k)["slot"] for n, k in got if n == "pagedserve_lora_adapter_resident"}
        assert resident == {ref.name: str(slots.slot(ref)) for ref in slots.resident}
        (info,) = [dict(k) for n, k in got if n == "vllm:lora_requests_info"]
        assert (info["max_lora"], info["running_lora_adapters"], info["waiting_lora_adapters"]) == ("2", "", "")

    run(tmp_path, scenario)


def few_tokens(context: list[int]) -> int:
    return 5 + sum((i + 1) * t for i, t in enumerate(context[-3:])) % 3


def test_adapters_stay_exact_through_chunked_prefill_preemption_and_ngram_drafts(tmp_path):
    async def scenario(engine, stub, servicers):
        vocab = engine.tokenizer.vocab_size
        servicers[0].fake.model = few_tokens  # outputs that repeat: n-gram drafts find matches
        names = ["a", "", "b", "c", "a", "b"]
        replies = await asyncio.gather(*(generate(stub, n, 30) for n in names))
        for name, reply in zip(names, replies):
            assert list(reply.token_ids) == expected(name, vocab, 30, model=few_tokens), name
        core = engine.cores[0]
        assert core.planner.num_preemptions > 0  # 10 blocks for six requests of up to 5 blocks
        assert max(len(s.token_ids) for plan in servicers[0].fake.steps for s in plan.seqs) <= 24  # chunked
        assert core.planner.drafter.counters.draft_tokens > 0
        assert any(s.lora_slot and s.num_drafts for plan in servicers[0].fake.steps for s in plan.seqs)

    run(
        tmp_path,
        scenario,
        num_blocks=10,
        max_num_batched_tokens=24,
        chunk_size=24,
        speculative_method="ngram",
        ngram_min=1,
    )


def test_prefix_cache_is_never_shared_across_adapters_or_with_the_base(tmp_path):
    async def scenario(engine, stub, servicers):
        first = await generate(stub, "a", 2)
        assert first.usage.cached_prompt_tokens == 0
        again = await generate(stub, "a", 2)
        assert again.usage.cached_prompt_tokens == 2 * BLOCK  # the same adapter shares its full blocks
        for other in ("b", ""):
            reply = await generate(stub, other, 2)
            assert reply.usage.cached_prompt_tokens == 0, other
        assert (await generate(stub, "", 2)).usage.cached_prompt_tokens == 2 * BLOCK

    run(tmp_path, scenario)


def test_unknown_and_refused_adapters_end_requests_by_name(tmp_path):
    async def scenario(engine, stub, servicers):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "nope")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "lora_adapter: no adapter 'nope' (loaded: a, b, c)" in info.value.details()
        servicers[0].refuse_adapters["b"] = "target_modules: the model has no module 'wq'"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "b")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "adapter 'b': target_modules: the model has no module 'wq'" in info.value.details()
        # The worker goes on serving the others.
        assert list((await generate(stub, "a")).token_ids) == expected("a", engine.tokenizer.vocab_size)

    run(tmp_path, scenario)


def test_admin_registers_and_forgets_adapters_while_requests_stream(tmp_path):
    async def scenario(engine, stub, servicers):
        admin = AdminServicer(engine.fleet)
        context = _Context()
        streaming = [asyncio.create_task(generate(stub, n, 40)) for n in ("a", "b", "")]
        while len(engine.cores[0].planner.requests) < 3 or not engine.cores[0].planner.running:
            await asyncio.sleep(0.002)
        got = scrape(engine)
        running = {dict(k)["adapter"]: v for (n, k), v in got.items() if n == "pagedserve_lora_requests_running"}
        queued = {dict(k)["adapter"]: v for (n, k), v in got.items() if n == "pagedserve_lora_requests_waiting"}
        assert running.get("a", 0) + queued.get("a", 0) == 1 and running.get("b", 0) + queued.get("b", 0) == 1
        (info,) = [dict(k) for (n, k) in got if n == "vllm:lora_requests_info"]
        # both adapters may still wait (the base request alone running): "" is no adapter
        assert set(info["running_lora_adapters"].split(",")) - {""} == {n for n in running if n}
        assert set(info["waiting_lora_adapters"].split(",")) - {""} == {n for n in queued if n}
        path = str(adapter_dir(tmp_path, "d", seed=9))
        reply = await admin.LoadLoraAdapter(admin_pb2.LoadLoraAdapterRequest(lora_name="d", lora_path=path), context)
        assert (reply.lora_name, reply.rank) == ("d", 4)
        assert list((await generate(stub, "d")).token_ids) == expected("d", engine.tokenizer.vocab_size)
        await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="a"), context)
        with pytest.raises(grpc.aio.AioRpcError, match="no adapter 'a'"):
            await generate(stub, "a")
        # The requests accepted before the unload finish, exact.
        for name, done in zip(("a", "b", ""), await asyncio.gather(*streaming)):
            assert list(done.token_ids) == expected(name, engine.tokenizer.vocab_size, 40)
        info = await stub.ModelInfo(serving_pb2.ModelInfoRequest())
        assert [(a.name, a.rank) for a in info.lora_adapters] == [("b", 4), ("c", 4), ("d", 4)]
        for bad, code in [
            (admin_pb2.LoadLoraAdapterRequest(lora_name="d", lora_path=path), grpc.StatusCode.ALREADY_EXISTS),
            (
                admin_pb2.LoadLoraAdapterRequest(lora_name="e", lora_path=str(tmp_path)),
                grpc.StatusCode.INVALID_ARGUMENT,
            ),
        ]:
            with pytest.raises(_Aborted) as aborted:
                await admin.LoadLoraAdapter(bad, context)
            assert aborted.value.args[0] is code
        with pytest.raises(_Aborted) as aborted:
            await admin.UnloadLoraAdapter(admin_pb2.UnloadLoraAdapterRequest(lora_name="zzz"), context)
        assert aborted.value.args[0] is grpc.StatusCode.NOT_FOUND

    run(tmp_path, scenario)


def test_a_miss_is_routed_to_the_worker_that_holds_its_adapter(tmp_path):
    async def scenario(engine, stub, servicers):
        await generate(stub, "a", 2)
        holder = next(c for c in engine.cores if c.planner.adapters.resident)
        for i in range(4):  # other prompts: no prefix anywhere
            await generate(stub, "a", 2, prompt=[50 + i, 7, 9])
        assert [len(s.adapter_loads) for s in servicers].count(0) == 1  # loaded on one worker only
        assert engine.fleet.router.counters[holder.info.address].by_reason.get("adapter", 0) >= 3

    run(tmp_path, scenario, num_workers=2)


def test_workers_without_lora_slots_and_bad_modules_are_refused_at_start(tmp_path):
    async def scenario(engine, stub, servicers):
        raise AssertionError("unreachable")

    with pytest.raises(
        StartupError, match="has 0 LoRA slots of rank up to 16: start it with --enable-lora and --max-lora-rank 8"
    ):
        run(tmp_path, scenario, worker_loras=0)
    with pytest.raises(StartupError, match="--lora-modules x=.*: use_dora: DoRA adapters are not served"):
        run(tmp_path, scenario, lora_modules=f"x={adapter_dir(tmp_path, 'x', use_dora=True)}")


def scrape(engine) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, as /metrics serves them."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


class _Aborted(Exception):
    pass


class _Context:
    """A servicer context whose abort raises with the code (admin.v1 called in-process)."""

    async def abort(self, code, details):
        raise _Aborted(code, details)

    def peer(self):
        return "test"
