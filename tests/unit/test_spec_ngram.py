"""Prompt-lookup drafts (scheduler_svc/speculative/ngram.py): the incremental
index proposes exactly what a rescan of the whole context would (vLLM's rule:
the longest suffix n-gram in [min, max] seen before, the tokens after its most
recent earlier occurrence), however the sequence grows."""

from __future__ import annotations

import random

import numpy as np
import pytest

from scheduler_svc.speculative.ngram import (
    NgramConfig,
    NgramIndex,
    NgramProposer,
    bulk_suffix_hashes,
    suffix_hashes,
)


def rescan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule by brute force: every suffix length from the longest, every earlier start from the latest."""
    end = len(tokens)
    for n in range(min(max_n, end - 1), min_n - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_the_examples_of_the_rule():
    tokens = [1, 2, 3, 4, 2, 3]
    assert NgramIndex(tokens, 2, 2).propose(4) == [4, 2, 3]  # vLLM's docstring example: fewer than k left
    tokens = [7, 1, 2, 9, 1, 2, 8, 5, 1, 2]
    assert NgramIndex(tokens, 1, 3).propose(2) == [8, 5]  # the most recent occurrence of [1, 2]
    tokens = [3, 1, 2, 6, 0, 2, 7, 3, 1, 2]
    assert NgramIndex(tokens, 1, 3).propose(2) == [6, 0]  # the longest match [3, 1, 2] beats the later [2]
    assert NgramIndex(tokens, 4, 4).propose(2) == []  # no earlier 4-gram
    assert NgramIndex([5, 5, 5, 5], 2, 3).propose(3) == [5]  # an occurrence overlapping the suffix
    assert NgramIndex([1, 2, 3], 1, 2).propose(3) == []
    assert NgramIndex([], 1, 2).propose(3) == []


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_the_index_agrees_with_a_rescan_as_the_sequence_grows(min_n: int, max_n: int):
    rng = random.Random(min_n * 10 + max_n)
    for trial in range(30):
        vocab = rng.choice([3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.choice([0, 5, 40, 200]))]  # > _BULK: numpy path
        index = NgramIndex(tokens, min_n, max_n)
        for _ in range(60):
            k = rng.randrange(0, 7)
            assert index.propose(k) == rescan(tokens, min_n, max_n, k), (trial, len(tokens))
            grow = rng.choice([1, 1, 2, 6, 50])  # a decode, an accepted run, a bulk catch-up
            tokens.extend(rng.randrange(vocab) for _ in range(grow))


def test_the_bulk_and_incremental_hashes_agree():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 300_000, size=100)
    ends = np.arange(6, 100)
    for n in range(1, 7):
        expected = [suffix_hashes(tokens.tolist(), int(e), 6)[n - 1] for e in ends]
        assert bulk_suffix_hashes(tokens, ends, n).tolist() == expected


def test_a_hash_collision_loses_a_proposal_but_never_makes_a_wrong_one():
    tokens = [1, 2, 3, 9, 9, 4, 5]
    index = NgramIndex(tokens, 2, 2)
    assert index.propose(2) == []
    (h,) = suffix_hashes(tokens, len(tokens), 2)[1:]
    index._follow[h] = 3  # [2, 3] sits before position 3, not [4, 5]: a colliding entry
    assert index.propose(2) == []


def test_the_proposer_keeps_one_index_per_sequence_and_honours_the_limit():
    proposer = NgramProposer(NgramConfig(num_speculative_tokens=3, ngram_min=1, ngram_max=2))
    a, b = [1, 2, 3, 4, 1, 2], [7, 8, 7]
    assert proposer.propose("a", a) == [3, 4, 1]
    assert proposer.propose("a", a, limit=1) == [3]
    assert proposer.propose("b", b) == [8, 7]
    a.extend([3, 4])
    assert proposer.propose("a", a) == [1, 2, 3]
    assert set(proposer.indices) == {"a", "b"}
    proposer.drop("a")
    assert set(proposer.indices) == {"b"}


def test_bad_settings_name_their_flag():
    assert NgramConfig(0, 2, 4).problems() == ["--num-speculative-tokens must be in [1, 16], got 0"]
    assert NgramConfig(5, 3, 2).problems() == ["--ngram-max must be >= --ngram-min (3), got 2"]
    assert NgramConfig(5, 0, 2).problems() == ["--ngram-min must be >= 1, got 0"]
    with pytest.raises(ValueError, match="--ngram-max"):
        NgramProposer(NgramConfig(5, 2, 17))
