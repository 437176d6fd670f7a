"""The stored responses (store: true): bounded in number and in lifetime, both flags
(--responses-store-size, --responses-store-ttl-s). The oldest goes first when full;
an expired or evicted id reads as missing (404), as a deleted one does."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # input items, outputs included, that previous_response_id continues
    at: float


class ResponseStore:
    def __init__(self, size: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._size, self._ttl_s, self._clock = size, ttl_s, clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self._size == 0:
            return
        self._entries[response["id"]] = Stored(response, conversation, self._clock())
        self._entries.move_to_end(response["id"])
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        entry = self._entries.get(response_id)
        if entry is not None and self._clock() - entry.at > self._ttl_s:
            del self._entries[response_id]
            return None
        return entry

    def delete(self, response_id: str) -> bool:
        return self.get(response_id) is not None and self._entries.pop(response_id, None) is not None
