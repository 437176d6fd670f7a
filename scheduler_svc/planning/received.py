"""Blocks a KV transfer wrote for a request that now waits on this worker
(engine/disagg.py): held under the transfer's scratch id until the request's
admission takes them as its computed prefix, so that neither eviction between the
move and the admission nor a pool without prefix caching (whose index finds
nothing) makes the decode worker compute the whole prompt again."""

from __future__ import annotations

from scheduler_svc.kv.interface import KVManager
from scheduler_svc.request import Request


class ReceivedKV:
    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        self._scratch: dict[str, Request] = {}  # by the id of the request the blocks are for

    @property
    def held_ids(self) -> list[str]:
        """The scratch ids holding blocks (live for the audit)."""
        return sorted(s.request_id for s in self._scratch.values())

    def attach(self, request_id: str, scratch: Request) -> None:
        """scratch: the transfer's blocks, its num_computed_tokens the tokens they hold."""
        self.release(request_id)
        self._scratch[request_id] = scratch

    def prefix(self, request: Request, hits: list[int], hit_tokens: int) -> tuple[list[int], int]:
        """The longer of the prefix index's hits and the request's received blocks,
        capped as every hit is (request.max_cache_hit_tokens)."""
        scratch = self._scratch.get(request.request_id)
        if scratch is None:
            return hits, hit_tokens
        size = self.kv.block_size
        count = min(scratch.num_computed_tokens, request.max_cache_hit_tokens) // size
        if count * size <= hit_tokens:
            return hits, hit_tokens
        return self.kv.block_table(scratch.request_id)[:count], count * size

    def release(self, request_id: str) -> None:
        """Free the request's received blocks (once its table shares them, or it ended)."""
        scratch = self._scratch.pop(request_id, None)
        if scratch is not None:
            self.kv.free(scratch)

    def release_all(self) -> None:
        """The worker's cache cannot be trusted (requeue_all): what was received is gone."""
        for request_id in list(self._scratch):
            self.release(request_id)
