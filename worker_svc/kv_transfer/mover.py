"""The two ends of a block move. The source serves named blocks as chunks
(ReadBlocks); the destination pulls named source blocks into named blocks of its
own (FetchBlocks). Both check only that the ids are well formed and that the
instances are the ones the scheduler named (a restarted worker holds nothing it
knew about); the scheduler holds the blocks on both sides meanwhile, so no step
writes them while they move."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import structlog

from worker_svc.kv_transfer.chunk import Chunk, TransferFailed
from worker_svc.kv_transfer.codec import BlockCodec
from worker_svc.kv_transfer.direct import DirectSender, check_secret
from worker_svc.kv_transfer.transport import BlockSource
from worker_svc.step.errors import InvalidStep

log = structlog.get_logger(__name__)

# A chunk's size: large enough that the per-message cost is small against the bytes,
# far below the default 256 MiB message limit.
CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class FetchOrder:
    transfer_id: int
    source: str
    source_instance_id: str
    instance_id: str
    src_block_ids: list[int]
    dst_block_ids: list[int]
    source_tls_server_name: str = ""  # the name the source's certificate carries, if not its host


@dataclass(frozen=True, slots=True)
class FetchResult:
    blocks: int
    bytes: int
    read_ms: float
    write_ms: float


class BlockMover:
    def __init__(
        self,
        codec: BlockCodec,
        instance_id: str,
        source: BlockSource,
        refusal: str | None = None,
        host: str = "127.0.0.1",
        timeout_s: float = 60.0,
    ) -> None:
        """refusal: why this worker cannot move blocks at all (a tensor-parallel or
        contiguous cache), said to whoever asks; None if it can. host: where a direct
        read's port listens (the worker's own --host); timeout_s: how long it waits."""
        self.codec = codec
        self.instance_id = instance_id
        self.source = source
        self.refusal = refusal
        self.host = host
        self.timeout_s = timeout_s

    def serve(self, block_ids: Sequence[int], instance_id: str, direct_secret: bytes = b"") -> Iterator[Chunk]:
        """ReadBlocks: the blocks' bytes, CHUNK_BYTES at a time (see _chunks), or with a
        direct_secret over a direct connection (_direct). Checked before the first chunk."""
        self._check_movable()
        if instance_id != self.instance_id:
            raise TransferFailed(f"instance_id: this worker is {self.instance_id}, not {instance_id}: it restarted")
        ids = self._checked("block_ids", block_ids)
        if direct_secret:
            check_secret(direct_secret)
            return self._direct(ids, direct_secret)
        return self._chunks(ids)

    def _direct(self, ids: list[int], secret: bytes) -> Iterator[Chunk]:
        """The port first (the call sends it before asking for more), then every chunk
        over the connection the reader opens; the call ends once they are sent."""
        sender = DirectSender(self.host, secret, self.timeout_s)  # listens only once the call streams
        try:
            yield Chunk(0, 0, self.codec.block_bytes, b"", sender.port)
            sender.send(self._chunks(ids))
        finally:
            sender.close()

    def _chunks(self, ids: list[int]) -> Iterator[Chunk]:
        """Each chunk's data is a view of one gather buffer the stream keeps: valid until
        the next chunk is asked for (the server sends a chunk before it asks)."""
        per_chunk = max(1, CHUNK_BYTES // self.codec.block_bytes)
        buffer = self.codec.buffer(min(per_chunk, len(ids)))
        for first in range(0, len(ids), per_chunk):
            part = ids[first : first + per_chunk]
            yield Chunk(first, len(part), self.codec.block_bytes, self.codec.read(part, buffer))

    def fetch(self, order: FetchOrder) -> FetchResult:
        """FetchBlocks: pull order.src_block_ids from order.source into order.dst_block_ids."""
        self._check_movable()
        if order.instance_id != self.instance_id:
            raise TransferFailed(f"instance_id: this worker is {self.instance_id}, not {order.instance_id}")
        dst = self._checked("dst_block_ids", order.dst_block_ids)
        if len(set(dst)) != len(dst):
            raise InvalidStep("dst_block_ids", "a block is named twice")
        if len(order.src_block_ids) != len(dst):
            raise InvalidStep("src_block_ids", f"{len(order.src_block_ids)} ids for {len(dst)} dst_block_ids")
        started = time.perf_counter()
        write_s, received, done = 0.0, 0, 0
        chunks = self.source.read(
            order.source,
            order.source_instance_id,
            list(order.src_block_ids),
            order.transfer_id,
            order.source_tls_server_name,
        )
        for chunk in chunks:
            if chunk.block_bytes != self.codec.block_bytes or chunk.first != done:
                raise TransferFailed(
                    f"{order.source} sent blocks {chunk.first}+{chunk.count} of {chunk.block_bytes} bytes; "
                    f"expected block {done} of {self.codec.block_bytes} bytes"
                )
            if done + chunk.count > len(dst) or len(chunk.data) != chunk.count * chunk.block_bytes:
                raise TransferFailed(f"{order.source} sent a chunk that does not match the blocks asked for")
            wrote = time.perf_counter()
            self.codec.write(dst[done : done + chunk.count], chunk.data)
            write_s += time.perf_counter() - wrote
            received += len(chunk.data)
            done += chunk.count
        if done != len(dst):
            raise TransferFailed(f"{order.source} sent {done} of {len(dst)} blocks")
        total_ms = (time.perf_counter() - started) * 1e3
        result = FetchResult(done, received, total_ms - write_s * 1e3, write_s * 1e3)
        log.debug("blocks fetched", transfer_id=order.transfer_id, source=order.source, **_fields(result))
        return result

    def _check_movable(self) -> None:
        if self.refusal is not None:
            raise TransferFailed(self.refusal)

    def _checked(self, field_name: str, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if not ids:
            raise InvalidStep(field_name, "names no block")
        if bad := [i for i in ids if not 0 <= i < self.codec.num_blocks]:
            raise InvalidStep(field_name, f"{bad[0]} is not a block id (the pool has {self.codec.num_blocks})")
        return ids


def _fields(result: FetchResult) -> dict[str, float]:
    return {
        "blocks": result.blocks,
        "bytes": result.bytes,
        "read_ms": round(result.read_ms, 3),
        "write_ms": round(result.write_ms, 3),
    }
