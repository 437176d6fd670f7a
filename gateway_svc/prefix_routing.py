"""Which scheduler gets a request, when the gateway fronts several (--schedulers).

Pure: no I/O, no gRPC. Each scheduler owns its workers' KV blocks and prefix
caches, so a request should go where requests with the same prompt prefix went
before. The gateway cannot see those caches; it sends equal prefixes to the
same place instead, and lets load bound how far that goes:

* **Key**: sha256 of the request's cache salt and its first `prefix_tokens`
  prompt token ids (`PrefixKeys`). The gateway tokenizes prompt text with the
  model's tokenizer (the `tokenizers` library, no torch), so the key is made of
  the tokens the scheduler hashes into its blocks: 32 tokens are the first two
  16-token KV blocks. A prompt of at most `prefix_tokens` tokens has no key (it
  shares at most one block with anything) and goes to the least loaded.
* **Consistent hashing** (`HashRing`): each scheduler has `replicas` points on
  a 64-bit ring; a key's schedulers, in order, are those met walking clockwise
  from the key's point. A scheduler that joins or leaves moves only the keys
  next to its points; every gateway replica computes the same order.
* **Bounded load** (`choose`: Mirrokni, Thorup and Zadimoghaddam's consistent
  hashing with bounded loads): the first scheduler in the key's order whose
  in-flight requests (counting this one) stay within `load_factor` x the
  average, or within the average + `slack`, takes it. A hot prefix fills its
  scheduler up to the bound and then spills over to the next in its order,
  always the same one, which then caches it too. The slack is an absolute
  allowance, as in SGLang's cache-aware router and our own worker router
  (scheduler_svc/engine/router.py: 16 sequences and 1.5x): a few requests of
  imbalance cost a scheduler of hundreds of sequences little, while a prefix
  computed twice costs a whole prefill.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer

# Characters tokenized per wanted token before falling back to the whole prompt:
# a token is a handful of characters in any tokenizer, 32 is far above that.
_CHARS_PER_TOKEN = 32


class PrefixKeys:
    """A request's routing key: its cache salt and first `prefix_tokens` token ids."""

    def __init__(self, tokenizer: Tokenizer | None, prefix_tokens: int):
        self.tokenizer = tokenizer
        self.prefix_tokens = prefix_tokens

    def key(self, prompt: str, prompt_token_ids: Sequence[int], cache_salt: str = "") -> bytes | None:
        ids = list(prompt_token_ids) if prompt_token_ids else self._head_ids(prompt)
        if len(ids) <= self.prefix_tokens:
            return None
        digest = hashlib.sha256(cache_salt.encode() + b"\0")
        digest.update(b"".join(i.to_bytes(4, "little", signed=True) for i in ids[: self.prefix_tokens]))
        return digest.digest()

    def _head_ids(self, prompt: str) -> list[int]:
        """The token ids of `prompt` as the scheduler tokenizes it (special tokens added),
        or of its head when that is long enough: cutting the text changes only the
        tokens of its last word, and the head holds far more than the key needs."""
        if self.tokenizer is None:
            return []
        head = prompt[: (self.prefix_tokens + 1) * _CHARS_PER_TOKEN]
        ids: list[int] = self.tokenizer.encode(head, add_special_tokens=True).ids
        if len(head) < len(prompt) and len(ids) < 2 * (self.prefix_tokens + 1):  # the cut may reach the key
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        return ids


class HashRing:
    def __init__(self, members: Sequence[str], replicas: int = 100):
        points = sorted((_point(f"{m}#{i}".encode()), m) for m in members for i in range(replicas))
        self._points = [p for p, _ in points]
        self._owners = [m for _, m in points]
        self.members = sorted(set(members))

    def order(self, key: bytes) -> list[str]:
        """Every member once, in the order met walking clockwise from the key's point."""
        start = bisect.bisect(self._points, _point(key))
        seen: dict[str, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)], None)
            if len(seen) == len(self.members):
                break
        return list(seen)


def choose(order: Sequence[str], loads: Mapping[str, int], load_factor: float, slack: int = 0) -> str:
    """The first member of `order` whose load, once this request is counted, stays
    within load_factor x the average, or within the average + `slack` requests
    (whichever is larger). With load_factor >= 1 there always is one."""
    average = (sum(loads[m] for m in order) + 1) / len(order)
    capacity = max(math.ceil(load_factor * average), math.ceil(average) + slack)
    return next((m for m in order if loads[m] + 1 <= capacity), least_loaded(order, loads))


def least_loaded(members: Sequence[str], loads: Mapping[str, int], rng: random.Random | None = None) -> str:
    """Fewest in-flight requests; a random one of those tied (spreads idle traffic)."""
    fewest = min(loads[m] for m in members)
    return (rng or random).choice([m for m in members if loads[m] == fewest])


def _point(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")
