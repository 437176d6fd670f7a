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

import contextlib
import hmac
import queue
import socket
import struct
import threading
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
    yield its frames until `total_blocks` blocks came. A thread receives the next frame
    while the caller writes this one into the cache (both release the GIL: the socket's
    copy and the tensor copy overlap; one after the other, the write was a fifth of the
    wall time). Each chunk's data is a view of one of two buffers, valid until the next
    chunk is asked for."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as err:
        raise TransferFailed(f"reading blocks from {host}:{port}: {err}") from None
    frames = _FrameReader(conn, total_blocks, timeout_s, f"{host}:{port}")
    try:
        conn.sendall(secret)
        frames.start()
        while (frame := frames.next()) is not None:
            chunk, buffer = frame
            yield chunk
            frames.release(buffer)
    except OSError as err:
        raise TransferFailed(f"reading blocks from {host}:{port}: {err}") from None
    finally:
        frames.stop()


class _FrameReader:
    """Reads frames on its own thread into two buffers that take turns: a buffer is
    filled again only once the caller released the chunk that views it."""

    def __init__(self, conn: socket.socket, total_blocks: int, timeout_s: float, source: str) -> None:
        self._conn, self._total, self._timeout_s, self._source = conn, total_blocks, timeout_s, source
        self._free: queue.Queue[bytearray | None] = queue.Queue()
        for _ in range(2):
            self._free.put(bytearray())
        self._ready: queue.Queue[tuple[Chunk, bytearray] | BaseException | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-direct-receive", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def next(self) -> tuple[Chunk, bytearray] | None:
        """The next frame and the buffer it views; None once every block came."""
        try:
            item = self._ready.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TransferFailed(f"no frame from {self._source} within {self._timeout_s:g} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def release(self, buffer: bytearray) -> None:
        self._free.put(buffer)

    def stop(self) -> None:
        # shutdown wakes a thread blocked in recv (close alone may not); one waiting for a
        # buffer gets None.
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)
        self._conn.close()
        self._free.put(None)
        self._thread.join(self._timeout_s)

    def _run(self) -> None:
        header = memoryview(bytearray(_HEADER.size))
        done = 0
        try:
            while done < self._total:
                buffer = self._free.get()
                if buffer is None:
                    return
                first, count, block_bytes = _HEADER.unpack(_read_exactly(self._conn, header))
                size = count * block_bytes
                if not 0 < count <= self._total - done or not 0 < size <= _MAX_FRAME_BYTES:
                    raise TransferFailed(f"a frame of {count} blocks of {block_bytes} bytes after {done} blocks")
                if size > len(buffer):
                    buffer = bytearray(size)
                data = _read_exactly(self._conn, memoryview(buffer)[:size])
                self._ready.put((Chunk(first, count, block_bytes, data), buffer))
                done += count
            self._ready.put(None)
        except OSError as err:
            self._ready.put(TransferFailed(f"reading blocks from {self._source}: {err}"))
        except BaseException as exc:  # handed to the caller, who raises it
            self._ready.put(exc)


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
