"""How a decode worker pulls blocks from the worker that holds them. BlockSource is
the interface (a NIXL or UCX connector could stand behind it later); GrpcBlockSource
is worker.v1 ReadBlocks: a server stream of chunks over the same authenticated,
optionally mutual-TLS channel every internal hop uses (the internal token the
scheduler sends the workers; with TLS this worker's certificate, which the
source's --tls-client-names must then list)."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from typing import Protocol

import grpc

from proto import worker_pb2
from svc_common.grpc_options import channel_options
from svc_common.peer_auth import bearer_metadata
from worker_svc.kv_transfer import direct
from worker_svc.kv_transfer.chunk import Chunk, TransferFailed

READ_BLOCKS_METHOD = f"/{worker_pb2.DESCRIPTOR.services_by_name['Worker'].full_name}/ReadBlocks"


class BlockSource(Protocol):
    def read(
        self, address: str, instance_id: str, block_ids: list[int], transfer_id: int, tls_server_name: str = ""
    ) -> Iterator[Chunk]:
        """The blocks' bytes in order, in chunks; raises TransferFailed. tls_server_name:
        the name the source's certificate carries when it is not the host in `address`."""
        ...


class GrpcBlockSource:
    def __init__(
        self, token: str | None, credentials: grpc.ChannelCredentials | None, max_message_mb: int, timeout_s: float
    ) -> None:
        self._metadata = bearer_metadata(token)
        self._credentials = credentials
        self._options = channel_options(max_message_mb, fast_reconnect=True)
        self._max_message_mb = max_message_mb
        self._timeout_s = timeout_s
        self._calls: dict[tuple[str, str], grpc.UnaryStreamMultiCallable] = {}  # a channel per source, kept
        self._lock = threading.Lock()

    def read(
        self, address: str, instance_id: str, block_ids: list[int], transfer_id: int, tls_server_name: str = ""
    ) -> Iterator[Chunk]:
        """Without TLS the bytes come over a direct connection (kv_transfer/direct.py)."""
        secret = secrets.token_bytes(direct.SECRET_BYTES) if self._credentials is None else b""
        request = worker_pb2.ReadBlocksRequest(
            transfer_id=transfer_id, instance_id=instance_id, block_ids=block_ids, direct_secret=secret
        )
        try:
            stream = self._read_blocks(address, tls_server_name)(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
            if not secret:
                yield from stream
                return
            try:
                opening = next(stream, None)
                if opening is None or not opening.direct_port:
                    raise TransferFailed(f"{address} named no port for a direct read")
                yield from direct.receive(address, opening.direct_port, secret, len(block_ids), self._timeout_s)
                for _ in stream:  # the source's status once it has sent everything
                    raise TransferFailed(f"{address} sent a chunk on the call of a direct read")
            finally:
                stream.cancel()  # a no-op once the call ended; else the source stops sending
        except grpc.RpcError as err:
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.Call) else str(err)
            raise TransferFailed(f"reading blocks from {address}: {why}") from None

    def _read_blocks(self, address: str, tls_server_name: str) -> grpc.UnaryStreamMultiCallable:
        """worker.v1 ReadBlocks on the source's channel, its chunks decoded in place."""
        key = (address, tls_server_name)
        with self._lock:
            if key not in self._calls:
                if self._credentials is None:
                    channel = grpc.insecure_channel(address, options=self._options)
                else:
                    options = channel_options(self._max_message_mb, True, tls_server_name)
                    channel = grpc.secure_channel(address, self._credentials, options=options)
                self._calls[key] = channel.unary_stream(
                    READ_BLOCKS_METHOD,
                    request_serializer=worker_pb2.ReadBlocksRequest.SerializeToString,
                    response_deserializer=decode_chunk,
                )
            return self._calls[key]


# BlocksChunk (proto/worker.proto) to and from its wire bytes around the blocks' bytes,
# without protobuf copying them. Building a BlocksChunk copies the data in, serializing
# copies it again, and reading `.data` of a parsed one copies it once more: three fresh
# buffers of megabytes a chunk, whose page faults cost more than the copies
# (bench/results/disaggregation.md). Here the header fields go through protobuf and the
# data is joined behind them in one copy; a received message is read in place. The
# bytes are a BlocksChunk: any protobuf client parses them, and the server registers
# ReadBlocks with encode_chunk as its serializer.
_DATA_FIELD = 4  # BlocksChunk.data
_DIRECT_PORT_FIELD = 230  # BlocksChunk.direct_port
_VARINT, _LENGTH_DELIMITED = 0, 2


def encode_chunk(chunk: Chunk) -> bytes:
    head = worker_pb2.BlocksChunk(
        first=chunk.first, count=chunk.count, block_bytes=chunk.block_bytes, direct_port=chunk.direct_port
    )
    tag = _varint(_DATA_FIELD << 3 | _LENGTH_DELIMITED)
    return b"".join((head.SerializeToString(), tag, _varint(len(chunk.data)), chunk.data))


def decode_chunk(message: bytes) -> Chunk:
    """A BlocksChunk's fields; its data a view of `message`, not a copy."""
    view = memoryview(message)
    fields: dict[int, int] = {}
    data = view[:0]
    at = 0
    while at < len(view):
        key, at = _read_varint(view, at)
        number, kind = key >> 3, key & 7
        if kind == _VARINT:
            fields[number], at = _read_varint(view, at)
        elif kind == _LENGTH_DELIMITED:
            size, at = _read_varint(view, at)
            if at + size > len(view):
                raise TransferFailed("a blocks chunk ends inside its data")
            if number == _DATA_FIELD:
                data = view[at : at + size]
            at += size
        else:
            raise TransferFailed(f"a blocks chunk carries field {number} of wire type {kind}")
    return Chunk(fields.get(1, 0), fields.get(2, 0), fields.get(3, 0), data, fields.get(_DIRECT_PORT_FIELD, 0))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, at: int) -> tuple[int, int]:
    value, shift = 0, 0
    while at < len(view):
        byte = view[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
    raise TransferFailed("a blocks chunk ends inside a varint")
