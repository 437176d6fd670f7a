"""Logit processing before sampling, on the rows that ask for it: tokens blocked
(min_tokens), logit_bias, and the presence / frequency / repetition penalties.

Pure functions over a [R, V] block of logits (the processed rows only), in
place, with vLLM v1's order and formulas:
  0. structured outputs: the tokens a row's bitmask does not allow -> -inf
     (`mask_tokens_`; scheduler_svc/structured/bitmask.py's `apply_bitmask` is its
     numpy reference and the test oracle);
  1. blocked ids -> -inf;
  2. + bias;
  3. repetition (HF / vLLM): a logit of a token seen in the prompt or generated
     so far is divided by the penalty when > 0, multiplied when <= 0; then
     frequency and presence (OpenAI): minus frequency * count and minus
     presence * (count > 0), over generated tokens only.
Each per-token input is a flat (row, token id[, value]) list, so building them
is a few numpy concatenations and applying them a few indexed tensor ops,
whatever the number of rows.
"""

from __future__ import annotations

import torch

_BIT = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, W] int32 words -> [M, vocab] allowed flags: id t is bit t % 32 of word t // 32 (ids
    past 32 * W are not allowed). An arithmetic shift keeps bit 31's meaning: only `& 1` is read."""
    bits = (words[:, :, None] >> _BIT.to(words.device)) & 1
    allowed = bits.view(words.shape[0], -1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))


def mask_tokens_(logits: torch.Tensor, rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of logits [R, V]: every token their bitmask words [M, W] do not allow -> -inf."""
    allowed = unpack_bitmask(words, logits.shape[-1])
    logits[rows] = logits[rows].masked_fill(~allowed, -torch.inf)
    return logits


def block_tokens_(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    logits[rows, token_ids] = -torch.inf
    return logits


def add_logit_bias_(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    return logits.index_put_((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def token_counts(num_rows: int, vocab: int, rows: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """[R, V] float: how often each row's list holds each token id."""
    counts = torch.zeros(num_rows, vocab, device=token_ids.device)
    return counts.index_put_((rows, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)


def apply_penalties_(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """logits, output_counts [R, V]; prompt_seen [R, V] bool; presence, frequency, repetition [R]."""
    generated = output_counts > 0
    factor = torch.where(prompt_seen | generated, repetition[:, None], 1.0)
    logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * generated
    return logits
