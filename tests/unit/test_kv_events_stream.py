"""KV events end to end through the real engine, in-process: fake workers over
gRPC (no model), pools small enough that blocks are evicted, admin.v1
SubscribeKvEvents over a real gRPC server and the vLLM-format ZMQ publisher on
real sockets. Subscribers rebuild each worker's exact set of cached block
hashes from the stream alone; the ZMQ one is written from vLLM's documented
schema (raw msgpack, no class of ours)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import msgpack
import pytest
import zmq
import zmq.asyncio

from proto import admin_pb2, admin_pb2_grpc, serving_pb2, serving_pb2_grpc
from scheduler_svc.api.admin import kv_batch_to_proto, start_admin_server
from scheduler_svc.api.kv_events_zmq import ZmqKvEventPublisher
from scheduler_svc.api.server import start_server
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine.engine import Engine
from scheduler_svc.engine.kv_events import KvEventBatch
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.fake_worker_server import audit_engine, start_fake_worker

NUM_BLOCKS = 12  # 16-token blocks: a few requests of 50 tokens fill it
WAIT_S = 30.0


def free_port_pair(avoid: tuple[int, ...] = ()) -> int:
    """A port p such that p and p + 1 are free (rank 0 and rank 1 of two workers)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        if not {port, port + 1} & set(avoid):
            return port


class Harness:
    def __init__(self, engine, stub, admin):
        self.engine, self.stub, self.admin = engine, stub, admin

    async def generate(self, ids: list[int], max_tokens: int = 10) -> None:
        request = serving_pb2.GenerateRequest(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
        )
        replies = [r async for r in self.stub.Generate(request, timeout=WAIT_S)]
        assert replies[-1].finished

    async def load(self, start: int, count: int) -> None:
        """`count` prompts of 40 tokens in 3 families sharing their first 32
        (prefix hits), 4 at a time, 10 tokens each: 3 full blocks per request."""
        prompts = [[i % 3 + 1] * 32 + [100 + (8 * i + k) % 600 for k in range(8)] for i in range(start, start + count)]
        for batch in range(0, count, 4):
            await asyncio.gather(*(self.generate(p) for p in prompts[batch : batch + 4]))

    async def idle(self) -> tuple[dict[str, set[bytes]], dict[str, int]]:
        """Once every worker is idle: each one's cached hashes and its last batch number."""
        while not all(c.planner.idle for c in self.engine.cores):
            await asyncio.sleep(0.005)
        truth = {c.info.address: set(c.planner.kv.pool.cached) for c in self.engine.cores}
        last = {w: s.next_seq - 1 for w, s in self.engine.fleet.kv_events.workers.items()}
        return truth, last

    async def collect(self, into: list[admin_pb2.KvEventBatch]) -> None:
        """A subscriber from the start that keeps reading until cancelled."""
        async for batch in self.admin.SubscribeKvEvents(admin_pb2.SubscribeKvEventsRequest()):
            into.append(batch)

    async def subscribe(self, last_seq: dict[str, int], until: dict[str, int]) -> list[admin_pb2.KvEventBatch]:
        """Read SubscribeKvEvents from `last_seq` until every worker reached `until`."""
        got, at = [], {w: last_seq.get(w, -1) for w in until}
        call = self.admin.SubscribeKvEvents(admin_pb2.SubscribeKvEventsRequest(last_seq=last_seq), timeout=WAIT_S)
        if all(at[w] >= s for w, s in until.items()):
            call.cancel()
            return got
        async for batch in call:
            got.append(batch)
            at[batch.worker] = batch.seq
            if all(at[w] >= s for w, s in until.items()):
                break
        call.cancel()
        return got


def run(scenario, num_workers: int = 1, **config):
    tokenizer = load_tokenizer(tiny_checkpoint("llama"))

    async def main():
        workers = [await start_fake_worker(NUM_BLOCKS, tokenizer.vocab_size) for _ in range(num_workers)]
        addresses = ",".join(address for _, address, _ in workers)
        engine = await Engine.connect(SchedulerConfig(workers=addresses, **config), tokenizer)
        server, port = await start_server(engine, "127.0.0.1", 0, 16, 16)
        admin, admin_port = await start_admin_server(engine.fleet, "127.0.0.1", 0)
        try:
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
                grpc.aio.insecure_channel(f"127.0.0.1:{admin_port}") as admin_channel,
            ):
                harness = Harness(
                    engine, serving_pb2_grpc.SchedulerStub(channel), admin_pb2_grpc.AdminStub(admin_channel)
                )
                await asyncio.wait_for(scenario(harness), 90)
        finally:
            await admin.stop(None)
            await server.stop(None)
            await engine.stop()
            for worker_server, _, _ in workers:
                await worker_server.stop(None)
        audit_engine(engine)

    asyncio.run(asyncio.wait_for(main(), 150))


def rebuild(batches: list[admin_pb2.KvEventBatch]) -> dict[str, set[bytes]]:
    """A router's view of each worker, from the gRPC stream alone."""
    view: dict[str, set[bytes]] = {}
    for batch in batches:
        hashes = view.setdefault(batch.worker, set())
        assert not batch.HasField("gap"), "the buffer held everything: no gap expected"
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                hashes.update(event.block_stored.block_hashes)
            elif kind == "block_removed":
                hashes.difference_update(event.block_removed.block_hashes)
            else:
                hashes.clear()
    return view


# ---- admin.v1 SubscribeKvEvents -------------------------------------------------
def test_grpc_subscribers_rebuild_each_workers_exact_cached_blocks_after_evictions():
    async def scenario(h: Harness):
        a, b = (c.info.address for c in h.engine.cores)
        live: list[admin_pb2.KvEventBatch] = []
        collector = asyncio.create_task(h.collect(live))  # subscribed before anything happened
        await h.load(0, 16)
        truth, last = await h.idle()
        assert sum(c.planner.kv.pool.blocks_reclaimed for c in h.engine.cores) > 0  # evictions happened
        replayed = await h.subscribe({}, last)  # a late subscriber: everything from the buffer
        assert rebuild(replayed) == truth
        kinds = {e.WhichOneof("event") for batch in replayed for e in batch.events}
        assert kinds == {"block_stored", "block_removed"}
        first = next(e.block_stored for batch in replayed for e in batch.events if e.HasField("block_stored"))
        assert first.block_size == 16 and len(first.token_ids) == 16 * len(first.block_hashes)
        assert first.medium == "GPU" and not first.HasField("lora_id")
        assert all(len(x) == 32 for batch in replayed for e in batch.events for x in e.block_stored.block_hashes)
        # Per worker: numbered 0, 1, 2, ... in order, with the worker's rank.
        for rank, worker in enumerate((a, b)):
            mine = [batch for batch in replayed if batch.worker == worker]
            assert [x.seq for x in mine] == list(range(last[worker] + 1))
            assert {x.data_parallel_rank for x in mine} == {rank}
        # The live subscriber saw the same batches as they happened.
        while len(live) < len(replayed):
            await asyncio.sleep(0.005)
        collector.cancel()
        by_worker = lambda x: (x.worker, x.seq)  # the live stream interleaves the workers
        assert sorted(live, key=by_worker) == sorted(replayed, key=by_worker)
        # Drained: the worker's blocks are gone from the scheduler's view.
        await h.engine.fleet.drain_worker(b, wait=True)
        after = await h.subscribe({a: last[a], b: last[b]}, {a: last[a], b: last[b] + 1})
        assert [(x.worker, x.seq) for x in after] == [(b, last[b] + 1)]
        assert after[0].events[0].WhichOneof("event") == "all_blocks_cleared"

    run(scenario, num_workers=2)


def test_reconnecting_inside_the_buffer_gets_exactly_the_missed_batches_outside_a_gap_marker():
    async def scenario(h: Harness):
        (w,) = (c.info.address for c in h.engine.cores)
        await h.load(0, 12)
        _, last = await h.idle()
        n = last[w] + 1
        assert n > 8, "the load must outrun the buffer of 4 batches"
        buffered = [kv_batch_to_proto(b) for b in h.engine.fleet.kv_events.workers[w].buffer]
        assert [b.seq for b in buffered] == list(range(n - 4, n))
        inside = await h.subscribe({w: n - 3}, last)
        assert inside == buffered[2:]  # exactly the two missed, event for event
        outside = await h.subscribe({w: 1}, last)
        gap, *rest = outside
        assert (gap.gap.first_missed_seq, gap.gap.last_missed_seq, gap.seq) == (2, n - 5, n - 5)
        assert not gap.events and rest == buffered
        fresh = await h.subscribe({}, last)  # no position: from seq 0, which is gone
        assert (fresh[0].gap.first_missed_seq, fresh[0].gap.last_missed_seq) == (0, n - 5) and fresh[1:] == buffered
        assert await h.subscribe({w: n - 1}, last) == []  # up to date

    run(scenario, kv_events_buffer_steps=4)


# ---- ZMQ, as vLLM publishes --------------------------------------------------------
END = -1


class VllmSubscriber:
    """A subscriber written from vLLM's documented KV-event schema
    (vllm/distributed/kv_events.py, examples/online_serving/kv_events_subscriber.py):
    multipart [topic, seq (8 bytes big-endian), payload]; payload the msgpack
    of KVEventBatch [ts, events, data_parallel_rank], each event
    [tag, fields...]; replay over a DEALER socket: send [b"", start seq],
    receive [b"", seq, payload] until seq is -1."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.live: dict[int, bytes] = {}  # seq -> payload

    async def receive(self, timeout_s: float) -> bool:
        if not await self.sub.poll(timeout_s * 1000):
            return False
        topic, seq, payload = await self.sub.recv_multipart()
        assert topic == b""
        self.live[int.from_bytes(seq, "big")] = payload
        return True

    async def replayed(self, start: int) -> dict[int, bytes]:
        await self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        got = {}
        while True:
            empty, seq, payload = await asyncio.wait_for(self.replay.recv_multipart(), WAIT_S)
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == END:
                return got
            got[int.from_bytes(seq, "big")] = payload


def apply_vllm(view: set[bytes], payload: bytes, rank: int) -> None:
    ts, events, data_parallel_rank = msgpack.unpackb(payload)
    assert isinstance(ts, float) and data_parallel_rank == rank
    for event in events:
        if event[0] == "BlockStored":
            _, block_hashes, parent, token_ids, block_size, lora_id, medium = event
            assert block_size == 16 and len(token_ids) == 16 * len(block_hashes) and lora_id is None
            assert medium == "GPU" and (parent is None or len(parent) == 32)
            view.update(block_hashes)
        elif event[0] == "BlockRemoved":
            _, block_hashes, medium = event
            view.difference_update(block_hashes)
        else:
            assert event == ["AllBlocksCleared"]
            view.clear()


def test_zmq_subscriber_from_vllms_schema_rebuilds_each_workers_cached_blocks():
    pub_port = free_port_pair()
    replay_port = free_port_pair(avoid=(pub_port, pub_port + 1))

    async def scenario(h: Harness):
        publisher = ZmqKvEventPublisher(h.engine.fleet.kv_events, f"tcp://*:{pub_port}", f"tcp://*:{replay_port}")
        ctx = zmq.asyncio.Context()
        # Rank r publishes on port + r (vLLM's data-parallel offsets).
        subs = [
            VllmSubscriber(ctx, f"tcp://127.0.0.1:{pub_port + r}", f"tcp://127.0.0.1:{replay_port + r}") for r in (0, 1)
        ]
        try:
            # PUB drops what it sends before a subscription arrives: send work
            # until each subscriber has heard something live.
            i = 0
            while not all(s.live for s in subs):
                await h.load(100 + 4 * i, 4)
                for s in subs:
                    while await s.receive(0.05):
                        pass
                i += 1
                assert i < 200, "no live message"
            first_live = [min(s.live) for s in subs]
            await h.load(0, 16)
            truth, last = await h.idle()
            assert sum(c.planner.kv.pool.blocks_reclaimed for c in h.engine.cores) > 0
            for rank, (s, worker) in enumerate(zip(subs, (c.info.address for c in h.engine.cores))):
                while max(s.live) < last[worker]:
                    assert await s.receive(WAIT_S), "a live batch is missing"
                # Connected, nothing is dropped: every batch from the first one heard.
                assert sorted(s.live) == list(range(first_live[rank], last[worker] + 1))
                replayed = await s.replayed(0)
                assert sorted(replayed) == list(range(last[worker] + 1))
                assert all(replayed[seq] == payload for seq, payload in s.live.items())  # byte for byte
                assert (await s.replayed(last[worker] - 1)).keys() == {last[worker] - 1, last[worker]}
                view: set[bytes] = set()
                for seq in sorted(replayed):
                    apply_vllm(view, replayed[seq], rank)
                assert view == truth[worker]
        finally:
            for s in subs:
                s.sub.close(linger=0)
                s.replay.close(linger=0)
            ctx.destroy(linger=0)
            await publisher.close()

    run(scenario, num_workers=2)


def test_a_port_in_use_fails_the_publisher():
    async def scenario(h: Harness):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError, match="--kv-events-zmq"):
                ZmqKvEventPublisher(h.engine.fleet.kv_events, f"tcp://*:{taken.getsockname()[1]}")
        assert h.engine.fleet.kv_events.sinks == []

    run(scenario)


@pytest.mark.parametrize(
    "flags, problem",
    [
        ({"kv_events_zmq": "tcp://*"}, "--kv-events-zmq"),
        ({"kv_events_zmq": "udp://*:5557"}, "--kv-events-zmq"),
        ({"kv_events_zmq": "tcp://*:5557", "kv_events_zmq_replay": "tcp://*:0"}, "--kv-events-zmq-replay"),
        ({"kv_events_zmq_replay": "tcp://*:5657"}, "--kv-events-zmq-replay"),
        ({"kv_events_buffer_steps": 0}, "--kv-events-buffer-steps"),
        # The events show every tenant's prompt tokens: beyond this machine only with admin keys.
        ({"kv_events_zmq": "tcp://*:5557"}, "--kv-events-zmq"),
        ({"kv_events_zmq": "ipc:///tmp/kv", "kv_events_zmq_replay": "tcp://0.0.0.0:5657"}, "--kv-events-zmq-replay"),
        ({"kv_events_zmq": "ipc:///tmp/kv", "api_keys": "k" * 20, "admin_port": -1}, "--kv-events-zmq"),
    ],
)
def test_kv_events_flags_are_checked(flags, problem):
    with pytest.raises(ValueError, match=problem):
        SchedulerConfig(model=str(tiny_checkpoint("llama")), **flags).validate()
    for ok in (
        {"kv_events_zmq": "ipc:///tmp/kv", "kv_events_zmq_replay": "tcp://127.0.0.1:5657"},
        {"kv_events_zmq": "tcp://*:5557", "kv_events_zmq_replay": "tcp://*:5657", "admin_keys": "a" * 20},
        {"kv_events_zmq": "tcp://proxy.example:5557", "api_keys": "k" * 20, "admin_port": -1},  # pushed to a proxy
    ):
        SchedulerConfig(model=str(tiny_checkpoint("llama")), **ok).validate()


def test_a_gap_marker_is_a_gap_even_at_seq_zero():
    gap = kv_batch_to_proto(KvEventBatch("w:1", 0, 0, 1.0, missed=(0, 0)))
    assert gap.HasField("gap") and (gap.gap.first_missed_seq, gap.gap.last_missed_seq) == (0, 0)
    assert not kv_batch_to_proto(KvEventBatch("w:1", 0, 0, 1.0)).HasField("gap")
