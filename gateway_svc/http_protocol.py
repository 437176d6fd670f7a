"""uvicorn's HTTP/1.1 protocol (h11) with a deadline on the request head.

uvicorn waits for a request's head for ever: a connection that opens and sends
nothing, or half a head, or a head a byte at a time, holds its slot and its
buffer as long as the client likes (its keep-alive timeout runs only between
requests, and any byte resets it). Here the head must be complete within
--header-timeout-s of the connection opening or of the first byte of the next
request on a kept-alive connection; else the connection is closed. The body's
pace is the edge guard's (gateway_svc/limits.py), which sees it as it arrives.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _HeadDeadlineProtocol(H11Protocol):
    header_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            self._arm()  # a kept-alive connection's next request starts here
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_too_slow)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_too_slow(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this deadline."""
    return type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
