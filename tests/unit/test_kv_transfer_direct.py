"""The direct read (kv_transfer/direct.py) over real sockets on 127.0.0.1: the
source's ReadBlocks stream names a port, the reader presents its secret and the
blocks arrive bit for bit in chunks; a connection with another secret is closed
without a byte, and a reader that never comes fails the source by name."""

from __future__ import annotations

import secrets
import socket
import threading
import time

import pytest
import torch

from tests.helpers.kv_blocks import filled_cache
from worker_svc.kv_transfer import direct
from worker_svc.kv_transfer.chunk import TransferFailed
from worker_svc.kv_transfer.codec import BlockCodec
from worker_svc.kv_transfer.mover import BlockMover


def serve_in_thread(mover: BlockMover, ids: list[int], secret: bytes):
    """The source's stream: its first chunk (the port) here, the rest sent by a thread
    as the gRPC server would ask for it; the thread's error, if any, in `errors`."""
    stream = mover.serve(ids, mover.instance_id, secret)
    opening = next(stream)
    errors: list[BaseException] = []

    def rest():
        try:
            for _ in stream:
                raise AssertionError("a direct read sends nothing more on the call")
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=rest)
    thread.start()
    return opening, thread, errors


def test_blocks_come_over_the_connection_in_chunks_bit_for_bit(monkeypatch):
    monkeypatch.setattr("worker_svc.kv_transfer.mover.CHUNK_BYTES", 1)  # one block a chunk
    src, dst = filled_cache(torch.bfloat16, 5), filled_cache(torch.bfloat16, 6)
    mover = BlockMover(BlockCodec(src.tensors), "src-1", source=None, timeout_s=10)  # type: ignore[arg-type]
    secret = secrets.token_bytes(direct.SECRET_BYTES)
    opening, thread, errors = serve_in_thread(mover, [3, 4, 1], secret)
    assert (opening.count, opening.data, opening.direct_port > 0) == (0, b"", True)
    # Someone else connects first, with another secret: closed, nothing sent.
    with socket.create_connection(("127.0.0.1", opening.direct_port), timeout=10) as intruder:
        intruder.sendall(b"x" * direct.SECRET_BYTES)
        assert intruder.recv(1) == b""
    codec = BlockCodec(dst.tensors)
    chunks = []
    for chunk in direct.receive("127.0.0.1:1", opening.direct_port, secret, 3, 10):
        chunks.append((chunk.first, chunk.count, chunk.block_bytes))
        codec.write([[0, 10, 6][chunk.first]], chunk.data)
    thread.join(10)
    assert errors == []
    assert chunks == [(0, 1, src.block_bytes), (1, 1, src.block_bytes), (2, 1, src.block_bytes)]
    for got, want in ((0, 3), (10, 4), (6, 1)):
        for d, s in zip(dst.tensors, src.tensors):
            assert torch.equal(d[:, got].view(torch.uint8), s[:, want].view(torch.uint8))


def test_a_reader_that_never_comes_fails_the_source_and_a_short_secret_is_refused():
    src = filled_cache(torch.float32, 7)
    mover = BlockMover(BlockCodec(src.tensors), "src-1", source=None, timeout_s=0.3)  # type: ignore[arg-type]
    with pytest.raises(TransferFailed, match="direct_secret: 3 bytes, not 32"):
        mover.serve([0], "src-1", b"abc")
    _, thread, errors = serve_in_thread(mover, [0, 1], secrets.token_bytes(direct.SECRET_BYTES))
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TransferFailed)
    assert "no reader presented the secret within 0.3 s" in str(errors[0])


def test_a_source_that_closes_mid_way_fails_the_reader():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def half():
        conn, _ = listener.accept()
        with conn:
            conn.recv(direct.SECRET_BYTES)
            conn.sendall(direct._HEADER.pack(0, 2, 100) + b"y" * 150)

    thread = threading.Thread(target=half)
    thread.start()
    with pytest.raises(TransferFailed, match="closed after 150 of 200 bytes"):
        list(direct.receive("127.0.0.1:1", port, b"s" * direct.SECRET_BYTES, 2, 10))
    thread.join(10)
    listener.close()


def test_a_frame_of_more_blocks_than_asked_for_is_refused_before_it_is_read():
    listener = socket.create_server(("127.0.0.1", 0))

    def garbled():
        conn, _ = listener.accept()
        with conn:
            conn.recv(direct.SECRET_BYTES)
            conn.sendall(direct._HEADER.pack(0, 3, 100))

    thread = threading.Thread(target=garbled)
    thread.start()
    with pytest.raises(TransferFailed, match="a frame of 3 blocks of 100 bytes after 0 blocks"):
        list(direct.receive("127.0.0.1:1", listener.getsockname()[1], b"s" * direct.SECRET_BYTES, 2, 10))
    thread.join(10)
    listener.close()


def frames_source(frames: list[bytes]) -> tuple[socket.socket, threading.Thread]:
    """A source that sends each payload as a one-block frame as fast as the reader takes it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def send():
        conn, _ = listener.accept()
        with conn:
            conn.recv(direct.SECRET_BYTES)
            for i, payload in enumerate(frames):
                conn.sendall(direct._HEADER.pack(i, 1, len(payload)) + payload)

    thread = threading.Thread(target=send)
    thread.start()
    return listener, thread


def test_a_chunk_stays_intact_while_the_next_frames_arrive():
    """The receiving thread runs ahead into the other buffer, never into the one the
    caller holds: each chunk still reads as sent after the source sent everything."""
    payloads = [bytes([i]) * 4096 for i in range(1, 7)]
    listener, thread = frames_source(payloads)
    received = []
    for chunk in direct.receive("127.0.0.1:1", listener.getsockname()[1], b"s" * direct.SECRET_BYTES, 6, 10):
        time.sleep(0.05)  # the receiving thread meanwhile reads the next frame into the other buffer
        received.append(bytes(chunk.data))
    thread.join(10)
    listener.close()
    assert received == payloads


def test_a_reader_abandoned_mid_way_stops_its_thread():
    listener, thread = frames_source([b"z" * 4096] * 8)
    frames = direct.receive("127.0.0.1:1", listener.getsockname()[1], b"s" * direct.SECRET_BYTES, 8, 10)
    assert next(frames).first == 0
    frames.close()  # the caller failed writing it (say): the connection and the thread go
    thread.join(10)
    listener.close()
    assert not [t for t in threading.enumerate() if t.name == "kv-direct-receive"]
