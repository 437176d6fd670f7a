"""Free-block queues: the order in which free blocks are handed out again.

Handing out a cached-free block evicts its prefix-cache entry, so this order is
the eviction policy:
  * lru      -- one queue, least recently freed first;
  * priority -- two LRU segments: blocks that were shared (a prefix hit or a
                fork reused them) are evicted only after every unshared one, so
                a system prompt many requests use outlives one-off tails.
Pinned blocks hold a reference and are never free, so never evicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from scheduler_svc.kv.block import KVBlock

EVICTION_POLICIES = ("lru", "priority")


class NoFreeBlocksError(RuntimeError):
    """allocate() asked for more blocks than the free queue holds."""


def _sentinel() -> KVBlock:
    """A list end: never handed out (id -1), so links need no None checks."""
    return KVBlock(-1)


class FreeBlockQueue:
    """Doubly linked list of free blocks, head = least recently freed.

    A deque cannot remove from the middle in O(1), and a prefix-cache hit must
    pull a cached-free block out from wherever it sits.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = _sentinel()
        self._tail = _sentinel()
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def popleft(self) -> KVBlock:
        if self._len == 0:
            raise NoFreeBlocksError("free block queue is empty")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        assert last is not None
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the queue"
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1


class PriorityFreeQueue:
    """Segmented LRU: unshared blocks are handed out (evicted) before shared ones."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self.unshared = FreeBlockQueue(blocks)
        self.shared = FreeBlockQueue()

    def __len__(self) -> int:
        return len(self.unshared) + len(self.shared)

    def __iter__(self) -> Iterator[KVBlock]:
        yield from self.unshared
        yield from self.shared

    def popleft(self) -> KVBlock:
        return (self.unshared if len(self.unshared) else self.shared).popleft()

    def append(self, block: KVBlock) -> None:
        keep_longer = block.shared and block.block_hash is not None
        (self.shared if keep_longer else self.unshared).append(block)
        block.in_shared_segment = keep_longer

    def remove(self, block: KVBlock) -> None:
        (self.shared if block.in_shared_segment else self.unshared).remove(block)


def make_free_queue(policy: str, blocks: Iterable[KVBlock]) -> FreeBlockQueue | PriorityFreeQueue:
    if policy == "lru":
        return FreeBlockQueue(blocks)
    if policy == "priority":
        return PriorityFreeQueue(blocks)
    raise ValueError(f"eviction policy {policy!r}: must be one of {', '.join(EVICTION_POLICIES)}")
