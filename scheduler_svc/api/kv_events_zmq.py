"""KV events over ZMQ as vLLM publishes them (vllm/distributed/kv_events.py,
ZmqEventPublisher), for KV-aware routers written for vLLM (`--kv-events-zmq`):

* one PUB socket per worker: the worker of data-parallel rank r on the
  endpoint's port + r (an ipc/inproc name gets the suffix `_dp{r}`), as vLLM
  places its data-parallel ranks. A wildcard (`*`, `0.0.0.0`, `::`) or
  loopback host, or an ipc/inproc endpoint is bound; any other is connected
  to (a proxy). The events show every tenant's prompt tokens: with admin keys
  the bound sockets take only subscribers whose ZMQ PLAIN password is one (any
  user name; `socket.plain_username = b"admin"; socket.plain_password = KEY`),
  and without them config.py allows only local endpoints.
* a batch is one multipart message [topic, seq, payload]: seq the worker's
  batch number as 8 bytes big-endian, payload vLLM's KVEventBatch in msgpack,
  in the array layout of its structs (array_like, tagged):
  [ts, [event, ...], data_parallel_rank] with each event
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
  ["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"].
  Hashes are bytes (msgpack bin, our 32-byte sha256 digests); lora_id is nil,
  medium "GPU" (the block pool) or the second tier's "CPU"/"DISK". (Recent vLLM
  releases encode each event as a map with a `type` key instead; the batch
  stays an array.)
* with `--kv-events-zmq-replay`, a ROUTER socket per worker (same offsets):
  a request [b"", start seq (8 bytes big-endian)] is answered with every
  buffered batch from that seq on, [b"", seq, payload] each, then
  [b"", -1 (8 bytes, signed), b""].

PUB drops what subscribers that have not connected yet, or are too slow,
would get (ZMQ's high-water mark): the sequence numbers show the gap, and the
replay socket or admin.v1 SubscribeKvEvents fills it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import structlog
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from scheduler_svc.engine.kv_events import KvEventBatch, KvEventHub, WorkerKvEvents
from scheduler_svc.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from svc_common.peer_auth import Credentials
from svc_common.zmq_endpoints import zmq_binds

log = structlog.get_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HWM = 100_000  # messages queued per subscriber before PUB drops (vLLM's default)


def event_to_wire(event: KVCacheEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.block_hashes),
            event.parent_block_hash,
            list(event.token_ids),
            event.block_size,
            None,  # lora_id
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.block_hashes), event.medium]
    assert isinstance(event, AllBlocksCleared)
    return ["AllBlocksCleared"]


def encode_batch(batch: KvEventBatch) -> bytes:
    payload: bytes = msgpack.packb([batch.ts, [event_to_wire(e) for e in batch.events], batch.rank], use_bin_type=True)
    return payload


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint of the worker of `rank`: vLLM's offset for data-parallel ranks."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


_ZAP_DOMAIN = b"pagedserve"


class _AdminKeyAuthenticator(ThreadAuthenticator):
    """ZAP for the sockets we bind: a PLAIN subscriber's password must be an admin key."""

    def __init__(self, context: zmq.Context[Any], credentials: Credentials) -> None:
        super().__init__(context)
        self._credentials = credentials

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        allowed = self._credentials.allows(password)
        if not allowed:
            log.warning("kv events subscriber refused", reason="invalid admin key")
        return allowed, b"" if allowed else b"invalid admin key"


class ZmqKvEventPublisher:
    """A sink of the engine's KvEventHub. Sockets are opened when a worker's
    stream starts; a bad endpoint fails the constructor (start-up)."""

    def __init__(
        self,
        hub: KvEventHub,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "",
        admin_keys: frozenset[str] = frozenset(),
    ) -> None:
        self._hub = hub
        self._endpoint, self._replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        # PUB sends never block (NOBLOCK, dropped at the high-water mark): a plain
        # context. The replay ROUTER is served by a task: an asyncio context.
        self._ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._pub: dict[int, zmq.Socket[bytes]] = {}
        self._replay: dict[int, asyncio.Task[None]] = {}
        # One ZAP handler per context: each checks the PLAIN passwords of its sockets' subscribers.
        self._auth = (
            [_AdminKeyAuthenticator(c, Credentials(admin_keys, "admin key")) for c in (self._ctx, self._async_ctx)]
            if admin_keys
            else []
        )
        for authenticator in self._auth:
            authenticator.start()
        try:
            hub.add_sink(self)
        except zmq.ZMQError as exc:
            self._destroy()
            raise OSError(f"--kv-events-zmq: cannot open {endpoint} / {replay_endpoint or '-'}: {exc}") from None

    def add_worker(self, worker: str, rank: int) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(_HWM)
        address = rank_endpoint(self._endpoint, rank)
        try:
            if zmq_binds(address):
                self._guard(pub)
                pub.bind(address)
            else:
                pub.connect(address)
        except zmq.ZMQError:
            pub.close(linger=0)
            raise
        self._pub[rank] = pub
        if self._replay_endpoint:
            router = self._async_ctx.socket(zmq.ROUTER)
            try:
                self._guard(router)
                router.bind(rank_endpoint(self._replay_endpoint, rank))
            except zmq.ZMQError:
                router.close(linger=0)
                raise
            stream = self._hub.workers[worker]
            self._replay[rank] = asyncio.create_task(self._serve_replay(stream, router), name=f"kv-replay-{rank}")
        log.info("kv events on zmq", worker=worker, rank=rank, endpoint=address)

    def _guard(self, socket: zmq.Socket[Any]) -> None:
        """With admin keys: only PLAIN subscribers whose password is one (the ZAP handler checks)."""
        if self._auth:
            socket.plain_server = True
            socket.zap_domain = _ZAP_DOMAIN

    def publish(self, batch: KvEventBatch) -> None:
        pub = self._pub.get(batch.rank)
        if pub is None:
            return  # its socket could not be opened (logged then)
        try:
            pub.send_multipart([self._topic, batch.seq.to_bytes(8, "big"), encode_batch(batch)], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("kv events dropped: zmq queue full", worker=batch.worker, seq=batch.seq)

    async def _serve_replay(self, stream: WorkerKvEvents, router: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("invalid kv event replay request", worker=stream.worker, frames=len(frames))
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                for batch in list(stream.buffer):  # a copy: sending awaits, steps go on
                    if batch.seq >= start_seq:
                        await router.send_multipart([client, b"", batch.seq.to_bytes(8, "big"), encode_batch(batch)])
                await router.send_multipart([client, b"", END_SEQ, b""])
        finally:
            router.close(linger=0)

    async def close(self) -> None:
        if self in self._hub.sinks:
            self._hub.sinks.remove(self)
        for task in self._replay.values():
            task.cancel()
        await asyncio.gather(*self._replay.values(), return_exceptions=True)
        self._destroy()

    def _destroy(self) -> None:
        for task in self._replay.values():
            task.cancel()
        for authenticator in self._auth:
            authenticator.stop()
        self._ctx.destroy(linger=0)  # closes its sockets
        self._async_ctx.destroy(linger=0)
