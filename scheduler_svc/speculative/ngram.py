"""Prompt-lookup (n-gram) drafts, vLLM's `--speculative-method ngram`: find the
longest suffix of a sequence, between `ngram_min` and `ngram_max` tokens, that
occurred earlier in its prompt or output, and propose the (up to) K tokens that
followed its most recent earlier occurrence.

vLLM rescans the whole context every step (numba, O(context) per row). Here each
sequence keeps an index, `NgramIndex`: one dict from an n-gram's hash to the
position right after its most recent occurrence, caught up with the tokens
appended since the last proposal. A step costs O(new tokens x n-gram lengths)
dict operations per row, whatever the context's length; a long prompt is indexed
once, with numpy, the first time the sequence is drafted.

Keys are 64-bit hashes, not tuples (a third of the memory: ~100 bytes per n-gram
length per token); a hit is checked against the tokens themselves, so a hash
collision can only lose a proposal, never make a wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1
_PRIME = 0x100000001B3  # FNV-1a's 64-bit multiplier
# Catching up over more new tokens than this goes through numpy (a prompt, a resumed
# request); fewer (a step's accepted run) through the Python loop, which is cheaper then.
_BULK = 32


@dataclass(frozen=True, slots=True)
class NgramConfig:
    """vLLM's meanings: --num-speculative-tokens, --ngram-min (prompt_lookup_min),
    --ngram-max (prompt_lookup_max)."""

    num_speculative_tokens: int = 5
    ngram_min: int = 2
    ngram_max: int = 4
    # The policy's batch rule (vLLM's speculative_disable_by_batch_size): no drafts while
    # more requests than this run. On a 2-core CPU (bench/spec_decode.py, copying text,
    # drafting on up to 4 rows) it gave 1.75x at 1 stream, 1.29x at 2, 0.81x at 4: every verified
    # position costs nearly a token's compute there, and a drafting row gives up its
    # overlap. On a GPU, whose step barely grows with the batch, the crossover is higher.
    disable_by_batch_size: int = 2

    def problems(self) -> list[str]:
        """What is wrong, each naming its flag (empty: valid)."""
        out = []
        if not 1 <= self.num_speculative_tokens <= 16:
            out.append(f"--num-speculative-tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.ngram_min < 1:
            out.append(f"--ngram-min must be >= 1, got {self.ngram_min}")
        if self.ngram_max < self.ngram_min:
            out.append(f"--ngram-max must be >= --ngram-min ({self.ngram_min}), got {self.ngram_max}")
        if self.ngram_max > 16:
            out.append(f"--ngram-max must be <= 16, got {self.ngram_max}")
        if self.disable_by_batch_size < 1:
            out.append(f"--speculative-disable-by-batch-size must be >= 1, got {self.disable_by_batch_size}")
        return out


def suffix_hashes(tokens: list[int], end: int, max_n: int) -> list[int]:
    """[h(tokens[end-1:end]), h(tokens[end-2:end]), ...]: the hashes of the n-grams
    ending at `end`, n = 1..min(max_n, end), each built from its last token back."""
    out, h = [], 0
    for n in range(1, min(max_n, end) + 1):
        h = ((h ^ (tokens[end - n] + 1)) * _PRIME) & _MASK
        out.append(h)
    return out


def bulk_suffix_hashes(tokens: np.ndarray, ends: np.ndarray, n: int) -> np.ndarray:
    """suffix_hashes' n-th entry for each of `ends` (all >= n), vectorized: uint64."""
    h = np.zeros(len(ends), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(1, n + 1):
            h = (h ^ (tokens[ends - j].astype(np.uint64) + np.uint64(1))) * np.uint64(_PRIME)
    return h


class NgramIndex:
    """One sequence's n-grams of lengths [min_n, max_n]: hash -> the position right
    after the most recent occurrence that has a token after it.

    `tokens` is the sequence's live list (prompt + output; the Request's
    all_token_ids), read, never written: the index follows it as it grows, and a
    sequence's tokens never change once appended (rejected drafts never enter it)."""

    __slots__ = ("tokens", "min_n", "max_n", "_follow", "_next_end", "_last")

    def __init__(self, tokens: list[int], min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.tokens = tokens
        self.min_n, self.max_n = min_n, max_n
        self._follow: dict[int, int] = {}
        self._next_end = 1  # the n-grams ending before this position (with a token after them) are indexed
        # (end, suffix_hashes there) of the last proposal: the n-grams the next catch-up indexes first
        self._last: tuple[int, list[int]] = (0, [])

    def __len__(self) -> int:
        return len(self._follow)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens: those that followed the most recent earlier occurrence of
        the longest suffix n-gram (min_n <= n <= max_n) seen before; [] if none."""
        tokens = self.tokens
        end = len(tokens)
        if end > self._next_end:
            self._catch_up(end)
        if k <= 0:
            return []
        hashes = suffix_hashes(tokens, end, self.max_n)
        self._last = (end, hashes)
        for n in range(len(hashes), self.min_n - 1, -1):
            follow = self._follow.get(hashes[n - 1])
            if follow is not None and follow >= n and tokens[follow - n : follow] == tokens[end - n : end]:
                return tokens[follow : follow + k]
        return []

    def _catch_up(self, end: int) -> None:
        """Index the n-grams ending at each position in [_next_end, end): each has its
        follower now. Later positions overwrite earlier ones: the most recent wins."""
        start = self._next_end
        if end - start > _BULK:
            self._bulk(start, end)
        else:
            follow, tokens, lo = self._follow, self.tokens, self.min_n - 1
            last_end, last_hashes = self._last
            for pos in range(start, end):
                hashes = last_hashes if pos == last_end else suffix_hashes(tokens, pos, self.max_n)
                for h in hashes[lo:]:
                    follow[h] = pos
        self._next_end = max(start, end)

    def _bulk(self, start: int, end: int) -> None:
        tokens = np.asarray(self.tokens[max(0, start - self.max_n) : end], dtype=np.int64)
        offset = max(0, start - self.max_n)
        for n in range(self.min_n, self.max_n + 1):
            ends = np.arange(max(start, n), end, dtype=np.int64)
            if ends.size:
                keys = bulk_suffix_hashes(tokens, ends - offset, n)
                self._follow.update(zip(keys.tolist(), ends.tolist()))  # in order: the most recent wins


class NgramProposer:
    """The drafts of every drafting sequence, each from its own NgramIndex, made on
    its first proposal and kept until `drop` (the request finished or stopped drafting)."""

    def __init__(self, config: NgramConfig) -> None:
        if problems := config.problems():
            raise ValueError("; ".join(problems))
        self.config = config
        self.indices: dict[str, NgramIndex] = {}

    def propose(self, key: str, tokens: list[int], limit: int | None = None) -> list[int]:
        """Up to min(K, limit) drafts for the sequence `key` whose tokens are `tokens`
        (the same list object every call: the index follows it). `limit`: what
        max_tokens and the length limit leave after the step's own token."""
        index = self.indices.get(key)
        if index is None or index.tokens is not tokens:
            index = self.indices[key] = NgramIndex(tokens, self.config.ngram_min, self.config.ngram_max)
        k = self.config.num_speculative_tokens if limit is None else min(limit, self.config.num_speculative_tokens)
        return index.propose(k)

    def drop(self, key: str) -> None:
        self.indices.pop(key, None)
