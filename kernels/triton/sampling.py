"""gumbel_argmax (kernels/reference.py's, same signature): the seeded Gumbel-max
sample of a batch of logits rows in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels import reference

# --------------------------------------------------------------------------- sampling


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    keys_ptr,
    thresholds_ptr,
    out_ptr,
    vocab,
    stride_row,
    MUL_A: tl.constexpr,
    MUL_B: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per row, one pass over its logits: each tile's scaled logits get
    # their noise (reference.gumbel's hash, in uint32 lanes whose products wrap as
    # the reference's masked int64 ones do) and the row keeps the best score so far
    # and its token; ties to the lowest id (first tile, then tl.argmax's left tie).
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    threshold = tl.load(thresholds_ptr + row)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_token = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        tokens = start + tl.arange(0, BLOCK_V)
        ok = tokens < vocab
        logits = tl.load(row_ptr + tokens, mask=ok, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(logits, temperature)  # IEEE, as torch divides
        h = key ^ tokens.to(tl.uint32)
        h = h ^ (h >> 16)
        h = h * MUL_A
        h = h ^ (h >> 15)
        h = h * MUL_B
        h = h ^ (h >> 16)
        uniform = ((h >> 9).to(tl.int32).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
        noise = -tl.log(-tl.log(uniform))
        score = tl.where(ok & (scaled >= threshold), scaled + noise, float("-inf"))
        tile_best = tl.max(score, 0)
        tile_token = start + tl.argmax(score, 0)
        better = tile_best > best
        best_token = tl.where(better, tile_token, best_token)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_token.to(tl.int64))


def gumbel_argmax(logits: Tensor, temperature: Tensor, keys: Tensor, thresholds: Tensor) -> Tensor:
    """reference.gumbel_argmax in one pass over the logits: no [N, V] temporaries
    (the reference hashes in int64 lanes, ~20 passes)."""
    num_rows, vocab = logits.shape
    assert temperature.shape == keys.shape == thresholds.shape == (num_rows,), (logits.shape, temperature.shape)
    assert logits.stride(-1) == 1, logits.stride()
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    block_v = min(2048, triton.next_power_of_2(vocab))
    _gumbel_argmax_kernel[(num_rows,)](
        logits,
        temperature.float().contiguous(),
        keys.contiguous(),
        thresholds.float().contiguous(),
        out,
        vocab,
        logits.stride(0),
        MUL_A=tl.constexpr(reference.HASH_MULTIPLIERS[0]),
        MUL_B=tl.constexpr(reference.HASH_MULTIPLIERS[1]),
        BLOCK_V=block_v,
    )
    return out
