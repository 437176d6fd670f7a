"""What a transfer moves: blocks' bytes in chunks, and how it fails."""

from __future__ import annotations

from dataclasses import dataclass


class TransferFailed(RuntimeError):
    """The blocks could not be read from their source (gone, restarted, refused, garbled)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    first: int  # index into the requested ids of the chunk's first block
    count: int
    block_bytes: int
    data: bytes | memoryview
    direct_port: int = 0  # a direct read's first chunk (kv_transfer/direct.py): no blocks, the port
