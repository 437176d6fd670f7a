"""KV events from REAL processes: a worker (tiny Llama, float32, a pool of 8
blocks, so requests evict each other's blocks) and a scheduler with
`--kv-events-zmq` and its replay socket. Two subscribers, one on admin.v1
SubscribeKvEvents and one written from vLLM's documented ZMQ schema (raw
msgpack), rebuild the same set of cached block hashes from their streams
alone; it has the scheduler's own count of cached blocks, and every hash is
one the test computes from the tokens it sent and got back."""

from __future__ import annotations

import contextlib

import grpc
import msgpack
import pytest
import zmq

from proto import admin_pb2, admin_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.client import SchedulerClient
from scheduler_svc.kv.block_pool import hash_block_tokens, hash_extra_keys
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.cluster import wait_idle
from tests.helpers.procs import Cluster, free_port

BS = 16
NUM_BLOCKS = 8
WAIT_S = 30.0


@pytest.fixture(scope="module")
def cluster():
    pub, replay = free_port(), free_port()
    with Cluster(
        tiny_checkpoint("llama"),
        ["--dtype", "float32", "--num-blocks", str(NUM_BLOCKS)],
        ["--kv-events-zmq", f"tcp://*:{pub}", "--kv-events-zmq-replay", f"tcp://*:{replay}"],
    ) as c:
        c.zmq = (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        yield c


def chain_hashes(tokens: list[int], extra_keys: tuple) -> list[bytes]:
    """The scheduler's hashes of the full blocks of `tokens` (docs/design.md, "Prefix hash chain")."""
    extra, parent, hashes = hash_extra_keys(extra_keys + (None,)), None, []
    for i in range(len(tokens) // BS):
        parent = hash_block_tokens(parent, tokens[i * BS : (i + 1) * BS], extra)
        hashes.append(parent)
    return hashes


def read_grpc(cluster: Cluster, until_seq: int) -> list[admin_pb2.KvEventBatch]:
    with grpc.insecure_channel(cluster.scheduler.admin_address) as channel:
        call = admin_pb2_grpc.AdminStub(channel).SubscribeKvEvents(
            admin_pb2.SubscribeKvEventsRequest(), metadata=cluster.admin_metadata, timeout=WAIT_S
        )
        batches = []
        for batch in call:
            batches.append(batch)
            if batch.seq >= until_seq:
                call.cancel()
                return batches
    raise AssertionError("the stream ended")


def zmq_socket(ctx: zmq.Context, kind: int, endpoint: str, password: str | None) -> zmq.Socket:
    """A subscriber (SUB) or replay client (DEALER); `password`: its ZMQ PLAIN password."""
    socket = ctx.socket(kind)
    if password is not None:
        socket.plain_username, socket.plain_password = b"admin", password.encode()
    if kind == zmq.SUB:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    return socket


def test_zmq_and_grpc_subscribers_rebuild_the_cached_blocks_after_evictions(cluster):
    """With the admin key the launcher made; the events show every tenant's prompts, so a
    subscriber without it (or with a wrong one) hears nothing on either socket."""
    ctx = zmq.Context()
    key = cluster.secrets.admin_key
    sub = zmq_socket(ctx, zmq.SUB, cluster.zmq[0], key)
    replay = zmq_socket(ctx, zmq.DEALER, cluster.zmq[1], key)
    outsiders = [zmq_socket(ctx, zmq.SUB, cluster.zmq[0], p) for p in (None, "not-the-admin-key")]
    outsiders += [zmq_socket(ctx, zmq.DEALER, cluster.zmq[1], p) for p in (None, "not-the-admin-key")]
    live: dict[int, bytes] = {}
    sent: list[list[int]] = []  # the computed tokens of every request (prompt + all outputs but the last)

    def receive(timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        live[int.from_bytes(seq, "big")] = payload
        return True

    try:
        with SchedulerClient(cluster.address) as client:

            def run(prompt: list[int], max_tokens: int = 8) -> None:
                done = client.generate(
                    prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=WAIT_S
                )
                sent.append(prompt + done.token_ids[:-1])

            # PUB drops what it sends before the subscription arrives: run requests until one is heard.
            for i in range(50):
                run([500 + i] * 20)
                if receive(200):
                    break
            first_live = min(live)
            # The load: 41-token prompts in 4 families sharing their first 32 tokens; with 7 of
            # their 8 outputs computed, 3 full blocks each. 20 distinct blocks through a pool of 8.
            for i in range(12):
                run([10 + i % 4] * 32 + [100 + 9 * i + k for k in range(9)])
            stats = wait_idle(client)
        assert stats.evictions > 0 and stats.blocks_used == 0
        # Every step's events were published before its tokens were streamed: the
        # replay socket now holds them all, and says where they end.
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        for outsider in outsiders:
            if outsider.type == zmq.DEALER:
                with contextlib.suppress(zmq.Again):  # no peer to queue for: refused at the handshake
                    outsider.send_multipart([b"", (0).to_bytes(8, "big")], flags=zmq.NOBLOCK)
        replayed: dict[int, bytes] = {}
        while True:
            empty, seq, payload = replay.recv_multipart()
            assert empty == b""
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed[int.from_bytes(seq, "big")] = payload
        last = max(replayed)
        assert sorted(replayed) == list(range(last + 1))
        # ZMQ live: from the first message heard on, none dropped, the same bytes as replayed.
        while max(live) < last:
            assert receive(int(WAIT_S * 1000)), "a live batch is missing"
        assert sorted(live) == list(range(first_live, last + 1))
        assert all(replayed[seq] == payload for seq, payload in live.items())
        # Connected as long, and told nothing: each would have its messages by now.
        assert not [o for o in outsiders if o.poll(200)]
        # The gRPC stream from the start: the buffer (1024 batches) holds it all.
        batches = read_grpc(cluster, last)
        assert [b.seq for b in batches] == list(range(last + 1))  # one worker, numbered from 0
        assert not any(b.HasField("gap") for b in batches)
        grpc_view: set[bytes] = set()
        for batch in batches:
            for event in batch.events:
                if event.HasField("block_stored"):
                    grpc_view.update(event.block_stored.block_hashes)
                elif event.HasField("block_removed"):
                    grpc_view.difference_update(event.block_removed.block_hashes)
                else:
                    grpc_view.clear()
        zmq_view: set[bytes] = set()
        removed = 0
        for seq in range(last + 1):
            ts, events, rank = msgpack.unpackb(replayed[seq])
            assert isinstance(ts, float) and rank == 0
            for event in events:
                if event[0] == "BlockStored":
                    _, hashes, parent, token_ids, block_size, lora_id, medium = event
                    assert (block_size, lora_id, medium) == (BS, None, "GPU") and len(token_ids) == BS * len(hashes)
                    zmq_view.update(hashes)
                elif event[0] == "BlockRemoved":
                    zmq_view.difference_update(event[1])
                    removed += len(event[1])
                else:
                    zmq_view.clear()
        assert removed == stats.evictions  # every reclaimed block was announced
    finally:
        for socket in (sub, replay, *outsiders):
            socket.close(linger=0)
        ctx.term()
    # Both streams agree with each other and with the scheduler's own count.
    assert zmq_view == grpc_view and len(zmq_view) == stats.blocks_cached_free > 0
    # Every hash is a block of what was sent: our hash chain over those tokens.
    with grpc.insecure_channel(cluster.workers[0].address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info = stub.Info(worker_pb2.InfoRequest(), metadata=cluster.worker_metadata, timeout=WAIT_S)
    keys = (info.model_name, info.model_type, info.dtype, info.kv_dtype)
    universe = {h for tokens in sent for h in chain_hashes(tokens, keys)}
    assert zmq_view <= universe
    assert set(chain_hashes(sent[-1], keys)) <= zmq_view  # the last request's blocks are the newest: still cached
