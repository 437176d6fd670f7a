"""Engine.add_worker / drain_worker / list_workers and routing through the router,
in-process: the real engine and serving.v1 server over gRPC against fake workers
(no torch, no model), each step slowed down a little so requests are still
running when a worker is drained."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from proto import serving_pb2_grpc
from scheduler_svc.api.server import start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.errors import (
    LastWorker,
    StartupError,
    UnknownWorker,
    WorkerExists,
    WorkerIncompatible,
    WorkerUnreachable,
)
from scheduler_svc.engine.router import WorkerState
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.aio_generate import generate
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.fake_worker_server import audit_engine, slow_down_steps, start_fake_worker

STEP_DELAY_S = 0.005


@pytest.fixture(autouse=True)
def slow_steps(monkeypatch):
    slow_down_steps(monkeypatch, STEP_DELAY_S)


def run(scenario, num_workers: int = 2, **config):
    """scenario(engine, stub, tokenizer, start_worker) with an engine over `num_workers` fake workers."""
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    async def main():
        servers = []

        async def start_worker(**kw):
            server, address, _ = await start_fake_worker(
                num_blocks=kw.pop("num_blocks", 64), vocab_size=tokenizer.vocab_size, **kw
            )
            servers.append(server)
            return address

        addresses = [await start_worker() for _ in range(num_workers)]
        engine = await Engine.connect(SchedulerConfig(workers=",".join(addresses), **config), tokenizer)
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                # Bounded: a hang becomes a failure with a traceback, not a stuck suite.
                await asyncio.wait_for(
                    scenario(engine, serving_pb2_grpc.SchedulerStub(channel), tokenizer, start_worker), 60
                )
        finally:
            await server.stop(None)
            await engine.stop()
            for s in servers:
                await s.stop(None)
        audit_engine(engine)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_drain_while_running_finishes_its_requests_and_removes_it():
    async def scenario(engine, stub, tokenizer, start_worker):
        a, b = (c.info.address for c in engine.cores)
        tasks = [asyncio.create_task(generate(stub, [5 + i, 9, 11, 13], 40)) for i in range(6)]
        while engine.fleet.list_workers()[0].running == 0:
            await asyncio.sleep(0.005)
        status = await engine.fleet.drain_worker(a)
        assert status.state is WorkerState.DRAINING and status.running + status.waiting > 0
        assert engine.accepting  # b still serves
        assert (await engine.fleet.drain_worker(a)).state is WorkerState.DRAINING  # twice is fine
        late = [asyncio.create_task(generate(stub, [7, 8, 9 + i], 5)) for i in range(4)]  # none may go to a
        removed = await engine.fleet.drain_worker(a, wait=True)
        assert removed.state is WorkerState.REMOVED
        assert (removed.running, removed.waiting, removed.blocks_used) == (0, 0, 0)
        assert removed.requests_finished == removed.requests_routed == status.requests_routed > 0
        done = await asyncio.gather(*tasks, *late)
        assert all(r.usage.completion_tokens == (40 if i < 6 else 5) for i, r in enumerate(done))
        assert [w.address for w in engine.fleet.list_workers()] == [b]
        assert a not in engine.fleet.router.counters
        assert await engine.fleet.drain_worker(a) == removed  # idempotent: its final record
        with pytest.raises(LastWorker):
            await engine.fleet.drain_worker(b)
        # Back again: a removed worker can be added, and gets requests.
        assert (await engine.fleet.add_worker(a)).state is WorkerState.SERVING
        assert [w.address for w in engine.fleet.list_workers()] == [b, a]

    run(scenario)


def test_cancelled_wait_does_not_undo_the_drain():
    async def scenario(engine, stub, tokenizer, start_worker):
        a, b = (c.info.address for c in engine.cores)
        task = asyncio.create_task(generate(stub, [5, 9, 11, 13], 40))
        while engine.fleet.list_workers()[0].running == 0:
            await asyncio.sleep(0.005)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.fleet.drain_worker(a, wait=True), 0.02)
        assert engine.fleet.list_workers()[0].state is WorkerState.DRAINING
        assert (await task).usage.completion_tokens == 40
        for _ in range(1000):  # up to 10 s: removal waits for the core's loop to stop (slow under load)
            if len(engine.cores) == 1:
                break
            await asyncio.sleep(0.01)
        assert [c.info.address for c in engine.cores] == [b]

    run(scenario)


def test_draining_again_after_the_removal_answers_the_final_record():
    # issue 28: a worker that finished draining between two admin calls made
    # DrainWorker(wait=True) answer NOT_FOUND. The drain is idempotent: a removed
    # worker's final record is answered for a while; an unknown address is still unknown.
    async def scenario(engine, stub, tokenizer, start_worker):
        a, b = (c.info.address for c in engine.cores)
        await generate(stub, [5, 9, 11, 13], 3)
        assert (await engine.fleet.drain_worker(a)).state is WorkerState.DRAINING
        while len(engine.cores) == 2:  # the drain ends by itself: no request holds the worker
            await asyncio.sleep(0.005)
        removed = await engine.fleet.drain_worker(a, wait=True)
        assert removed.state is WorkerState.REMOVED and removed.address == a
        assert await engine.fleet.drain_worker(a) == removed  # without wait too, and again
        assert [w.address for w in engine.fleet.list_workers()] == [b]
        with pytest.raises(UnknownWorker):
            await engine.fleet.drain_worker("127.0.0.1:1")
        # Added back, it is a worker again: draining it is a new drain.
        await engine.fleet.add_worker(a)
        again = await engine.fleet.drain_worker(a, wait=True)
        assert again.state is WorkerState.REMOVED and again.requests_routed == 0

    run(scenario)


def test_core_stop_ends_a_loop_that_absorbed_a_cancellation():
    # Python 3.11's asyncio.wait_for returns instead of raising when its awaited
    # future completes as the cancellation arrives; a loop that then goes on kept
    # core.stop() (and a drain) waiting forever. stop() cancels until it ends.
    async def scenario():
        core = EngineCore(client=None, info=SimpleNamespace(address="127.0.0.1:1"), planner=None, tokenizer=None)
        cancels = 0

        async def absorbs_the_first_cancel():
            nonlocal cancels
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    cancels += 1
                    if cancels > 1:
                        raise

        core._run = absorbs_the_first_cancel
        core.start()
        await asyncio.sleep(0)
        await asyncio.wait_for(core.stop(), 10)
        assert core._task.cancelled() and cancels == 2

    asyncio.run(scenario())


def test_add_worker_errors_and_draining_the_last_worker():
    async def scenario(engine, stub, tokenizer, start_worker):
        (a,) = (c.info.address for c in engine.cores)
        with pytest.raises(WorkerExists):
            await engine.fleet.add_worker(a)
        with pytest.raises(WorkerIncompatible, match="same model"):
            await engine.fleet.add_worker(await start_worker(block_size=32))
        with pytest.raises(WorkerIncompatible, match="at most"):
            await engine.fleet.add_worker(await start_worker(num_blocks=2))  # 32 tokens < max_model_len
        with pytest.raises(WorkerUnreachable, match="did not answer"):
            await engine.fleet.add_worker("127.0.0.1:1")
        assert [w.address for w in engine.fleet.list_workers()] == [a]
        with pytest.raises(LastWorker):
            await engine.fleet.drain_worker(a)
        removed = await engine.fleet.drain_worker(a, wait=True, allow_last=True)
        assert removed.state is WorkerState.REMOVED and engine.fleet.list_workers() == [] and not engine.accepting
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(stub, [5, 6, 7], 3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        b = await start_worker()
        assert (await engine.fleet.add_worker(b)).state is WorkerState.SERVING and engine.accepting
        assert (await generate(stub, [5, 6, 7], 3)).usage.completion_tokens == 3

    run(scenario, num_workers=1, connect_timeout_s=0.5, max_model_len=256)


def test_shared_prefix_colocates_and_handover_skips_draining_workers():
    async def scenario(engine, stub, tokenizer, start_worker):
        system = list(range(10, 58))  # 3 full blocks
        # The first request computes the prefix; the five after it must find it cached
        # (sent together with it, all six could be admitted before any block is cached).
        await generate(stub, system + [100], 4)
        await asyncio.gather(*(generate(stub, system + [100 + i], 4) for i in range(1, 6)))
        routed = {w.address: w.requests_routed for w in engine.fleet.list_workers()}
        assert sorted(routed.values()) == [0, 6]  # one worker for the shared prompt
        owner = next(a for a, n in routed.items() if n == 6)
        assert next(w for w in engine.fleet.list_workers() if w.address == owner).prefix_hit_tokens > 0
        other = next(a for a in routed if a != owner)
        # A new prompt goes to the worker whose free blocks hold no cached prefix.
        task = asyncio.create_task(generate(stub, [7, 8, 9], 40))
        while next(w for w in engine.fleet.list_workers() if w.address == other).running == 0:
            await asyncio.sleep(0.005)
        # handover: a lost worker's requests never go to a draining one.
        assert (await engine.fleet.drain_worker(other)).state is WorkerState.DRAINING
        source = next(c for c in engine.cores if c.info.address == owner)
        assert engine.requests.handover(source) is False  # the only other worker is draining
        assert (await task).usage.completion_tokens == 40

    run(scenario, num_workers=2)


def test_max_num_seqs_comes_from_the_workers_info_and_a_larger_one_is_refused():
    """Issue 28: --max-num-seqs need not be repeated. Unset on the scheduler it is each
    worker's (Info), 256 for a worker that does not say; set, it may not exceed a worker's
    (its memory and decode graphs are sized for that): refused when the worker joins."""

    async def scenario(engine, stub, tokenizer, start_worker):
        (unsaid,) = engine.cores
        assert unsaid.planner.config.max_num_seqs == 256
        await engine.fleet.add_worker(await start_worker(max_num_seqs=3))
        said = engine.cores[-1]
        assert said.planner.config.max_num_seqs == 3
        await engine.fleet.drain_worker(unsaid.info.address, wait=True)
        # Six at once on a worker started for three: never more than three run.
        calls = asyncio.gather(*(generate(stub, [5, 6, 7 + i], 40) for i in range(6)))
        most = 0
        while not calls.done():
            most = max(most, said.planner.num_running)
            await asyncio.sleep(0.001)
        assert most == 3
        assert all(r.usage.completion_tokens == 40 for r in calls.result())

    run(scenario, num_workers=1)

    async def larger(engine, stub, tokenizer, start_worker):
        with pytest.raises(WorkerIncompatible, match="--max-num-seqs 8 is more than worker .* --max-num-seqs 4"):
            await engine.fleet.add_worker(await start_worker(max_num_seqs=4))
        assert (await engine.fleet.add_worker(await start_worker(max_num_seqs=8))).state is WorkerState.SERVING

    run(larger, num_workers=1, max_num_seqs=8)


def test_a_scheduler_asking_more_sequences_than_its_worker_does_not_start():
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    async def main():
        server, address, _ = await start_fake_worker(64, tokenizer.vocab_size, max_num_seqs=16)
        try:
            with pytest.raises(StartupError, match="--max-num-seqs 32 is more than worker"):
                await Engine.connect(SchedulerConfig(workers=address, max_num_seqs=32), tokenizer)
        finally:
            await server.stop(None)

    asyncio.run(main())
