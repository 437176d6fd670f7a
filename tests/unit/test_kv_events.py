"""KV events: what the pool records as blocks enter and leave its prefix index
(exact events on scripted scenarios; a replay of the events rebuilds the index
after random runs with evictions, forks and preemptions), and the per-worker
streams behind admin.v1 SubscribeKvEvents: numbering, the replay buffer, gap
markers, subscribers that resume."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.engine.kv_events import KvEventBatch, KvEventHub, WorkerKvEvents
from scheduler_svc.kv.block_manager import KVCacheManager
from scheduler_svc.kv.block_pool import BlockPool, hash_block_tokens, hash_extra_keys
from scheduler_svc.kv.events import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler_svc.planning.planner import Planner, PlannerConfig
from scheduler_svc.request import Request
from tests.helpers.fake_worker import FakeWorker
from tests.helpers.planner_sim import BS, VOCAB, reference, req, step

EXTRA = ("m",)
seq_ids = iter(range(10**8, 10**9))


def make(num_blocks=8, **config):
    config.setdefault("max_model_len", 4096)
    pool = BlockPool(num_blocks, BS, record_events=True)
    return Planner(PlannerConfig(**config), KVCacheManager(pool, BS, extra_keys=EXTRA)), FakeWorker(num_blocks, BS)


def chain(tokens: list[int], salt=None) -> list[bytes]:
    """The hashes of the full blocks of `tokens`, as the manager computes them."""
    extra, parent, hashes = hash_extra_keys(EXTRA + (salt,)), None, []
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], extra)
        hashes.append(parent)
    return hashes


def run(planner, worker):
    while planner.has_work():
        step(planner, worker)


def apply(view: set[bytes], events) -> None:
    """What a router does with the events."""
    for event in events:
        if isinstance(event, BlockStored):
            view.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            view.difference_update(event.block_hashes)
        else:
            view.clear()


# ---- what the pool records ---------------------------------------------------
def test_prefill_stores_its_full_blocks_chained_then_decode_stores_the_next():
    planner, worker = make(chunk_size=16)
    prompt = list(range(100, 140))  # 40 tokens: chunks of 16, 16, 8
    planner.add(req("a", prompt, max_tokens=10))  # 49 tokens computed in all: 3 full blocks
    tokens = prompt + reference(prompt, 10)
    h = chain(tokens)
    step(planner, worker)
    assert planner.kv.take_events() == [BlockStored((h[0],), None, tuple(prompt[:16]), BS)]
    step(planner, worker)
    assert planner.kv.take_events() == [BlockStored((h[1],), h[0], tuple(prompt[16:32]), BS)]
    step(planner, worker)  # the last chunk: its block is not full yet
    assert planner.kv.take_events() == []
    run(planner, worker)
    # The block that decoding filled: 8 prompt tokens and 8 outputs.
    assert planner.kv.take_events() == [BlockStored((h[2],), h[1], tuple(tokens[32:48]), BS)]
    assert planner.kv.take_events() == []  # taken


def test_a_prompt_whose_blocks_are_cached_stores_only_the_rest():
    planner, worker = make()
    shared = list(range(200, 232))  # two full blocks
    planner.add(req("a", shared + [1, 2], max_tokens=1))
    run(planner, worker)
    planner.kv.take_events()
    planner.add(req("b", shared + list(range(300, 316)) + [5], max_tokens=1))
    run(planner, worker)
    (stored,) = planner.kv.take_events()
    h = chain(shared + list(range(300, 316)))
    assert stored == BlockStored((h[2],), h[1], tuple(range(300, 316)), BS)


def test_eviction_removes_and_reset_clears():
    planner, worker = make(num_blocks=4)
    planner.add(req("a", list(range(100, 148)) + [1], max_tokens=1))  # 3 full blocks + 1 token: 4 blocks
    run(planner, worker)
    a = chain(list(range(100, 148)))
    assert [type(e) for e in planner.kv.take_events()] == [BlockStored]
    planner.add(req("b", list(range(500, 532)) + [1], max_tokens=1))  # 3 blocks: reclaims a's LRU ones
    run(planner, worker)
    removed, stored = planner.kv.take_events()
    # a's table was freed tail first: its partial block, then blocks 2, 1, 0 join the LRU queue in that order
    assert removed == BlockRemoved((a[2], a[1]))
    assert stored.block_hashes == tuple(chain(list(range(500, 532))))
    assert set(planner.kv.pool.cached) == {a[0], *stored.block_hashes}
    planner.kv.reset_prefix_cache()
    assert planner.kv.take_events() == [AllBlocksCleared()]


def test_no_events_unless_asked():
    pool = BlockPool(4, BS)
    planner = Planner(PlannerConfig(max_model_len=4096), KVCacheManager(pool, BS))
    planner.add(req("a", list(range(40)), max_tokens=1))
    run(planner, FakeWorker(4, BS))
    assert pool.cached and pool.take_events() == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(1, 20), st.sampled_from([1, 1, 1, 3])),
        min_size=1,
        max_size=12,
    ),
    num_blocks=st.integers(6, 24),
    policy=st.sampled_from(["lru", "priority"]),
)
def test_the_events_rebuild_the_index_after_any_run(ops, num_blocks, policy):
    """Shared prefixes (a few prompt families), parallel samples, evictions
    and preemptions: replaying the events gives exactly the index's hashes,
    checked after every step."""
    pool = BlockPool(num_blocks, BS, eviction_policy=policy, record_events=True)
    planner = Planner(PlannerConfig(max_model_len=4096, chunk_size=16), KVCacheManager(pool, BS))
    worker, view = FakeWorker(num_blocks, BS, VOCAB), set()
    for i, (family, length, max_tokens, n) in enumerate(ops):
        prompt = [family * 7 + 1] * min(length, 16) + list(range(1000 + i, 1000 + i + max(0, length - 16)))
        length = len(prompt)
        if length + max_tokens > num_blocks * BS or (n > 1 and length < 2):
            continue
        if n > 1:  # what the server builds: a prefill-only parent, n children that fork off it
            children = [req(f"r{i}/{c}", prompt, max_tokens=max_tokens) for c in range(n)]
            planner.add(Request(f"r{i}", next(seq_ids), prompt[:-1], prefill_only=True, children=children))
        else:
            planner.add(req(f"r{i}", prompt, max_tokens=max_tokens))
    while planner.has_work():
        step(planner, worker)
        apply(view, pool.take_events())
        assert view == set(pool.cached)
    planner.kv.reset_prefix_cache()
    apply(view, pool.take_events())
    assert view == set() == set(pool.cached)


# ---- per-worker streams -------------------------------------------------------
def batches(stream: WorkerKvEvents, count: int) -> None:
    for i in range(count):
        stream.publish([BlockRemoved((bytes([i]),))])


def test_batches_are_numbered_and_empty_steps_publish_nothing():
    stream = WorkerKvEvents("w:1", rank=2, capacity=8)
    stream.publish([])
    batches(stream, 3)
    assert [b.seq for b in stream.buffer] == [0, 1, 2] and {b.rank for b in stream.buffer} == {2}
    assert [b.seq for b in stream.since(0)] == [1, 2]
    assert stream.since(2) == []


def test_a_position_inside_the_buffer_gets_exactly_the_missed_batches_and_outside_a_gap_marker():
    stream = WorkerKvEvents("w:1", capacity=4)
    batches(stream, 10)  # 0..9 published, 6..9 buffered
    assert [b.seq for b in stream.since(6)] == [7, 8, 9]
    assert stream.since(6) == list(stream.buffer)[1:]
    gap, *rest = stream.since(2)
    assert (gap.missed, gap.seq, gap.events) == ((3, 5), 5, ())
    assert [b.seq for b in rest] == [6, 7, 8, 9]
    gap, *rest = stream.since(-1)  # a new subscriber: from the first batch, which is gone
    assert gap.missed == (0, 5) and len(rest) == 4
    gap, *rest = stream.since(42)  # a position from an earlier run of the scheduler
    assert gap.missed == (0, 5) and len(rest) == 4
    assert [b.seq for b in stream.since(5)] == [6, 7, 8, 9]  # no gap: nothing missed


def test_restarted_numbering_with_everything_buffered_is_still_a_gap():
    stream = WorkerKvEvents("w:1", capacity=8)
    batches(stream, 2)
    gap, *rest = stream.since(7)
    assert gap.missed == (0, -1) and gap.seq == -1 and [b.seq for b in rest] == [0, 1]


def test_subscribers_get_every_worker_resume_where_they_left_and_wait_for_more():
    class Sink:
        def __init__(self):
            self.workers, self.seen = [], []

        def add_worker(self, worker, rank):
            self.workers.append((worker, rank))

        def publish(self, batch):
            self.seen.append((batch.worker, batch.seq))

    async def main():
        hub = KvEventHub(buffer_steps=2)
        a = hub.worker("a:1")
        batches(a, 2)
        sink = Sink()
        hub.add_sink(sink)  # told of a:1, which already has batches
        got: list[KvEventBatch] = []

        async def read(last_seq, count):
            async for batch in hub.subscribe(last_seq):
                got.append(batch)
                if len(got) == count:
                    return

        reader = asyncio.create_task(read({"a:1": 0}, 3))
        await asyncio.sleep(0)
        assert [(x.worker, x.seq) for x in got] == [("a:1", 1)]  # caught up, now waiting
        b = hub.worker("b:1")  # joins later: read from its first batch
        batches(b, 1)
        hub.worker_removed("a:1")
        await asyncio.wait_for(reader, 5)
        assert [(x.worker, x.seq) for x in got] == [("a:1", 1), ("a:1", 2), ("b:1", 0)]
        assert got[1].events == (AllBlocksCleared(),)
        assert sink.workers == [("a:1", 0), ("b:1", 1)]
        assert sink.seen == [("b:1", 0), ("a:1", 2)]
        got.clear()
        await asyncio.wait_for(read({}, 4), 5)  # a new subscriber: a:1's batch 0 has left the buffer
        assert [(x.worker, x.seq, x.missed) for x in got] == [
            ("a:1", 0, (0, 0)),
            ("a:1", 1, None),
            ("a:1", 2, None),
            ("b:1", 0, None),
        ]

    asyncio.run(main())
