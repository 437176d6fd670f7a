"""Token bitmasks in numpy: the packing rule and the torch-free reference of
applying a mask to logits (the worker's device implementation is tested
against `apply_bitmask`).

A mask has one row per constrained sequence of a step and W = ceil(V/32)
int32 words per row (V = the grammar vocabulary, vocab.py). Token id t is
allowed in row r iff t < 32*W and bit t % 32 of word t // 32 of row r is set
(bit 0 the least significant; the words are little-endian int32, so the sign
bit is id 32*w + 31).

Applying it: every disallowed logit becomes -inf, in the logits the sampler
draws from, *before* penalties, temperature, top-k/top-p/min-p and greedy's
argmax, so every sampling mode (greedy included) picks an allowed id. Logits
columns past 32*W are disallowed; mask bits past the logits width are
ignored. The reported logprobs (of the sampled id and the top alternatives)
stay those of the raw distribution, as without a mask. A row that allows no
id is a caller's bug (the grammar engine never produces one: compile rejects
a grammar whose first mask is empty and a matcher that errs is reported)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def unpack(mask: NDArray[np.int32], width: int) -> NDArray[np.bool_]:
    """[rows, W] words -> [rows, width] allowed flags (ids past 32*W: False)."""
    rows = np.atleast_2d(np.ascontiguousarray(mask, dtype="<i4"))
    bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little").astype(np.bool_)
    if bits.shape[1] >= width:
        return bits[:, :width]
    return np.concatenate([bits, np.zeros((bits.shape[0], width - bits.shape[1]), np.bool_)], axis=1)


def pack(allowed: NDArray[np.bool_], words: int) -> NDArray[np.int32]:
    """[rows, V] allowed flags -> [rows, words] int32 words (V <= 32*words)."""
    rows = np.atleast_2d(allowed)
    assert rows.shape[1] <= 32 * words, f"{rows.shape[1]} ids do not fit {words} words"
    padded = np.zeros((rows.shape[0], 32 * words), np.bool_)
    padded[:, : rows.shape[1]] = rows
    return np.packbits(padded, axis=1, bitorder="little").view("<i4").astype(np.int32)


def allowed_ids(row: NDArray[np.int32], vocab_size: int) -> NDArray[np.intp]:
    """The ids one mask row allows, ascending."""
    return np.flatnonzero(unpack(row, vocab_size)[0])


def allowed_count(row: NDArray[np.int32], vocab_size: int) -> int:
    return int(unpack(row, vocab_size)[0].sum())


def apply_bitmask(logits: NDArray[np.floating], mask: NDArray[np.int32]) -> NDArray[np.floating]:
    """The masked copy of [rows, V] `logits` the sampler draws from (see the module doc)."""
    rows = np.atleast_2d(logits)
    words = np.atleast_2d(mask)
    assert rows.shape[0] == words.shape[0], f"{rows.shape[0]} logits rows, {words.shape[0]} mask rows"
    return np.where(unpack(words, rows.shape[1]), rows, -np.inf).astype(rows.dtype, copy=False)
