"""Worker-to-worker KV transfer (worker_svc/kv_transfer/): a block's bytes carry every
tensor of the pool (K, V, a quantized cache's scales and zero points) and land in the
named blocks of another pool bit for bit; the mover checks what it is asked for and
refuses by name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from proto import worker_pb2
from tests.helpers.kv_blocks import BLOCK, BLOCKS, HEAD_DIM, HEADS, LAYERS, filled_cache
from worker_svc.attention.kv_cache import PagedKVCache
from worker_svc.kv_transfer.chunk import Chunk, TransferFailed
from worker_svc.kv_transfer.codec import BlockCodec
from worker_svc.kv_transfer.mover import BlockMover, FetchOrder
from worker_svc.kv_transfer.transport import decode_chunk, encode_chunk
from worker_svc.step.errors import InvalidStep


class LocalSource:
    """The transport as a direct read of another pool (the gRPC one is tested end to end)."""

    def __init__(self, mover: BlockMover) -> None:
        self.mover = mover
        self.calls: list[list[int]] = []

    def read(
        self, address: str, instance_id: str, block_ids: list[int], transfer_id: int, tls_server_name: str = ""
    ) -> Iterator[Chunk]:
        self.calls.append(block_ids)
        return self.mover.serve(block_ids, instance_id)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_blocks_land_bit_for_bit_with_their_scales(dtype):
    src, dst = filled_cache(dtype, 1), filled_cache(dtype, 2)
    codec = BlockCodec(src.tensors)
    assert codec.block_bytes == src.block_bytes  # what Info reports: scales included
    before = [t.clone() for t in dst.tensors]
    BlockCodec(dst.tensors).write([7, 2, 9], codec.read([0, 5, 11]))
    for s, d, b in zip(src.tensors, dst.tensors, before):
        for got, want in ((7, 0), (2, 5), (9, 11)):
            assert torch.equal(d[:, got].view(torch.uint8), s[:, want].view(torch.uint8))
        untouched = [i for i in range(BLOCKS) if i not in (7, 2, 9)]
        assert torch.equal(d[:, untouched].view(torch.uint8), b[:, untouched].view(torch.uint8))


def test_fetch_moves_named_blocks_in_chunks(monkeypatch):
    monkeypatch.setattr("worker_svc.kv_transfer.mover.CHUNK_BYTES", 1)  # one block a chunk
    src, dst = filled_cache(torch.float32, 3), filled_cache(torch.float32, 4)
    source = BlockMover(BlockCodec(src.tensors), "src-1", source=None)  # type: ignore[arg-type]
    local = LocalSource(source)
    mover = BlockMover(BlockCodec(dst.tensors), "dst-1", local)
    result = mover.fetch(FetchOrder(5, "prefill:1", "src-1", "dst-1", [3, 4, 1], [0, 10, 6]))
    assert (result.blocks, result.bytes) == (3, 3 * src.block_bytes)
    assert local.calls == [[3, 4, 1]]
    for got, want in ((0, 3), (10, 4), (6, 1)):
        for d, s in zip(dst.tensors, src.tensors):  # as bytes: random bits hold NaNs
            assert torch.equal(d[:, got].view(torch.uint8), s[:, want].view(torch.uint8))


def test_refusals_name_what_is_wrong():
    src, dst = filled_cache(torch.float32, 5), filled_cache(torch.float32, 6)
    source = BlockMover(BlockCodec(src.tensors), "src-1", source=None)  # type: ignore[arg-type]
    mover = BlockMover(BlockCodec(dst.tensors), "dst-1", LocalSource(source))

    def fetch(src_ids, dst_ids, source_instance="src-1", instance="dst-1"):
        return mover.fetch(FetchOrder(1, "prefill:1", source_instance, instance, src_ids, dst_ids))

    with pytest.raises(InvalidStep, match="dst_block_ids: a block is named twice"):
        fetch([1, 2], [3, 3])
    with pytest.raises(InvalidStep, match="dst_block_ids: 12 is not a block id"):
        fetch([1], [12])
    with pytest.raises(InvalidStep, match="src_block_ids: 1 ids for 2"):
        fetch([1], [2, 3])
    with pytest.raises(InvalidStep, match="block_ids: -1 is not a block id"):
        fetch([-1], [2])
    with pytest.raises(TransferFailed, match="restarted"):  # the source is another instance now
        fetch([1], [2], source_instance="src-0")
    with pytest.raises(TransferFailed, match="instance_id"):  # so is this worker
        fetch([1], [2], instance="dst-0")
    refusing = BlockMover(BlockCodec(dst.tensors), "dst-1", LocalSource(source), refusal="a tensor-parallel cache")
    with pytest.raises(TransferFailed, match="tensor-parallel"):
        refusing.fetch(FetchOrder(1, "p", "src-1", "dst-1", [1], [2]))


def test_a_source_that_sends_other_blocks_is_refused():
    small = PagedKVCache(LAYERS, BLOCKS, HEADS, BLOCK, HEAD_DIM // 2, torch.float32, torch.device("cpu"))
    dst = filled_cache(torch.float32, 7)
    source = BlockMover(BlockCodec(small.tensors), "src-1", source=None)  # type: ignore[arg-type]
    mover = BlockMover(BlockCodec(dst.tensors), "dst-1", LocalSource(source))
    with pytest.raises(TransferFailed, match="bytes; expected block 0"):
        mover.fetch(FetchOrder(1, "prefill:1", "src-1", "dst-1", [1], [2]))


def test_runs_of_consecutive_blocks_land_and_a_reused_buffer_serves_each_read():
    src, dst = filled_cache(torch.float32, 8), filled_cache(torch.float32, 9)
    codec, dst_codec = BlockCodec(src.tensors), BlockCodec(dst.tensors)
    buffer = codec.buffer(4)
    pairs = [([0, 1, 2, 5], [3, 4, 5, 9]), ([6, 7], [10, 0])]  # runs 3-5 and 9; then 10, 0
    for src_ids, dst_ids in pairs:
        dst_codec.write(dst_ids, codec.read(src_ids, buffer))
    for src_ids, dst_ids in pairs:
        for want, got in zip(src_ids, dst_ids):
            for s, d in zip(src.tensors, dst.tensors):
                assert torch.equal(d[:, got].view(torch.uint8), s[:, want].view(torch.uint8))
    with pytest.raises(ValueError, match="a buffer of .* bytes for 5 blocks"):
        codec.read([0, 1, 2, 3, 4], buffer)


def test_chunks_on_the_wire_are_blocks_chunk_messages():
    """encode_chunk/decode_chunk against protobuf itself: each parses what the other writes."""
    data = bytes(range(256)) * 700  # long enough for a 3-byte length
    ours = encode_chunk(Chunk(300, 2, 89_600, memoryview(data)))
    parsed = worker_pb2.BlocksChunk.FromString(ours)
    assert (parsed.first, parsed.count, parsed.block_bytes, parsed.data) == (300, 2, 89_600, data)
    theirs = worker_pb2.BlocksChunk(first=7, count=1, block_bytes=len(data), data=data).SerializeToString()
    chunk = decode_chunk(theirs)
    assert (chunk.first, chunk.count, chunk.block_bytes, bytes(chunk.data)) == (7, 1, len(data), data)
    assert decode_chunk(worker_pb2.BlocksChunk(count=0).SerializeToString()).data == b""
    with pytest.raises(TransferFailed, match="ends inside its data"):
        decode_chunk(theirs[:-1])
    with pytest.raises(TransferFailed, match="ends inside a varint"):
        decode_chunk(b"\x08\x80")
    with pytest.raises(TransferFailed, match="wire type 5"):
        decode_chunk(b"\x0d\x00\x00\x00\x00")
