"""How a decode worker pulls blocks from the worker that holds them. BlockSource is
the interface (a NIXL or UCX connector could stand behind it later); GrpcBlockSource
is worker.v1 ReadBlocks: a server stream of chunks over the same authenticated,
optionally mutual-TLS channel every internal hop uses (the internal token the
scheduler sends the workers; with TLS this worker's certificate, which the
source's --tls-client-names must then list)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc

from proto import worker_pb2, worker_pb2_grpc
from svc_common.grpc_options import channel_options
from svc_common.peer_auth import bearer_metadata


class TransferFailed(RuntimeError):
    """The blocks could not be read from their source (gone, restarted, refused, garbled)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    first: int  # index into the requested ids of the chunk's first block
    count: int
    block_bytes: int
    data: bytes


class BlockSource(Protocol):
    def read(self, address: str, instance_id: str, block_ids: list[int], transfer_id: int) -> Iterator[Chunk]:
        """The blocks' bytes in order, in chunks; raises TransferFailed."""
        ...


class GrpcBlockSource:
    def __init__(
        self, token: str | None, credentials: grpc.ChannelCredentials | None, max_message_mb: int, timeout_s: float
    ) -> None:
        self._metadata = bearer_metadata(token)
        self._credentials = credentials
        self._options = channel_options(max_message_mb, fast_reconnect=True)
        self._timeout_s = timeout_s
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}  # one channel per source, kept
        self._lock = threading.Lock()

    def read(self, address: str, instance_id: str, block_ids: list[int], transfer_id: int) -> Iterator[Chunk]:
        request = worker_pb2.ReadBlocksRequest(transfer_id=transfer_id, instance_id=instance_id, block_ids=block_ids)
        try:
            for chunk in self._stub(address).ReadBlocks(request, timeout=self._timeout_s, metadata=self._metadata):
                yield Chunk(chunk.first, chunk.count, chunk.block_bytes, chunk.data)
        except grpc.RpcError as err:
            why = f"{err.code().name}: {err.details()}" if isinstance(err, grpc.Call) else str(err)
            raise TransferFailed(f"reading blocks from {address}: {why}") from None

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._lock:
            if address not in self._stubs:
                if self._credentials is None:
                    channel = grpc.insecure_channel(address, options=self._options)
                else:
                    channel = grpc.secure_channel(address, self._credentials, options=self._options)
                self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
            return self._stubs[address]
