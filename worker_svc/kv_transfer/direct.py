"""Blocks' bytes over a plain TCP connection beside the ReadBlocks call, for a
deployment without TLS (bench/results/disaggregation.md: Python gRPC spends about
a CPU-second per GB receiving, and as much sending; a socket costs the kernel's
copy). The ReadBlocks call stays the authenticated control path: the reader sends
a fresh secret in it (direct_secret), the source listens on a port of its own host
for this one transfer and names it in the stream's first chunk (direct_port), the
reader connects and presents the secret, and the bytes follow as frames (a 16-byte
header: first, count, block_bytes; then the blocks' bytes). The call ends once they
are sent, with the source's status. A connection without the secret is closed."""

from __future__ import annotations

import hmac
import socket
import struct
import time
from collections.abc import Iterable, Iterator

from worker_svc.kv_transfer.chunk import Chunk, TransferFailed

SECRET_BYTES = 32
_HEADER = struct.Struct("<IIq")  # first, count, block_bytes
_MAX_FRAME_BYTES = 1 << 30  # a garbled header must not make the reader allocate without bound


class DirectSender:
    """The source's end: listen for the one reader that presents `secret`."""

    def __init__(self, host: str, secret: bytes, timeout_s: float) -> None:
        check_secret(secret)
        self._secret = secret
        self._timeout_s = timeout_s
        self._listener = socket.create_server((host.strip("[]"), 0), family=_family(host))
        self.port: int = self._listener.getsockname()[1]

    def send(self, chunks: Iterable[Chunk]) -> None:
        """Accept the reader, then each chunk as a frame; closes the connection after."""
        with self._listener, self._accept() as conn:
            for chunk in chunks:
                conn.sendall(_HEADER.pack(chunk.first, chunk.count, chunk.block_bytes))
                conn.sendall(chunk.data)

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> socket.socket:
        deadline = time.monotonic() + self._timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._listener.settimeout(left)
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                break
            conn.settimeout(self._timeout_s)
            try:
                presented = _read_exactly(conn, memoryview(bytearray(SECRET_BYTES)))
            except (OSError, TransferFailed):
                conn.close()
                continue
            if hmac.compare_digest(bytes(presented), self._secret):
                return conn
            conn.close()  # not the reader this transfer is for
        raise TransferFailed(f"no reader presented the secret within {self._timeout_s:g} s")


def check_secret(secret: bytes) -> None:
    if len(secret) != SECRET_BYTES:
        raise TransferFailed(f"direct_secret: {len(secret)} bytes, not {SECRET_BYTES}")


def receive(address: str, port: int, secret: bytes, total_blocks: int, timeout_s: float) -> Iterator[Chunk]:
    """The reader's end: connect to the source's host at `port`, present `secret`, and
    yield its frames until `total_blocks` blocks came; each chunk's data is a view of
    one receive buffer, valid until the next chunk is asked for."""
    host = address.rpartition(":")[0].strip("[]")
    buffer = bytearray()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(secret)
            header = memoryview(bytearray(_HEADER.size))
            done = 0
            while done < total_blocks:
                first, count, block_bytes = _HEADER.unpack(_read_exactly(conn, header))
                size = count * block_bytes
                if not 0 < count <= total_blocks - done or not 0 < size <= _MAX_FRAME_BYTES:
                    raise TransferFailed(f"a frame of {count} blocks of {block_bytes} bytes after {done} blocks")
                if size > len(buffer):
                    buffer = bytearray(size)
                yield Chunk(first, count, block_bytes, _read_exactly(conn, memoryview(buffer)[:size]))
                done += count
    except OSError as err:
        raise TransferFailed(f"reading blocks from {host}:{port}: {err}") from None


def _read_exactly(conn: socket.socket, into: memoryview) -> memoryview:
    at = 0
    while at < len(into):
        got = conn.recv_into(into[at:])
        if got == 0:
            raise TransferFailed(f"the connection closed after {at} of {len(into)} bytes")
        at += got
    return into


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
