"""Token sampling on the logits' device: greedy, temperature, top-k, top-p.

A sample is a Gumbel race, argmax(logits / T + Gumbel noise), over the tokens
the top-k/top-p filter keeps. The noise of token t is a hash of (row key, t)
computed with integer tensor ops, and a seeded row's key is a hash of
(seed, position): the same request samples the same token at the same
position whatever else is in the batch, on any device. Unseeded rows get keys
drawn on the host each step and go through the same path.

Only one tensor crosses to the host per step: token ids and logprobs packed
as float64 columns (ids < 2**53 are exact), so more columns (top-N logprobs)
can join the same copy.
"""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.step_input import Sampling

_M32 = 0xFFFFFFFF
# Columns of the per-row parameter block sent to the device in one copy.
_TEMP, _GREEDY, _TOP_K, _TOP_P, _KEY = range(5)
_NCOLS = 5


def row_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """splitmix64 of (seed, position) in uint64 (numpy wraps by definition), top 32 bits."""
    with np.errstate(over="ignore"):
        z = seeds * np.uint64(0x9E3779B97F4A7C15) + positions + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(32)


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """x *= c mod 2**32 for 0 <= x < 2**32, in 16-bit halves of c so no int64 product
    overflows (signed overflow is undefined in the C++ kernels, not merely wrapping).
    In place: a [B, vocab] int64 temporary per op made the hash 2-3x slower on CPU."""
    high = x * (c >> 16)
    high.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_M32)


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons), in place, on int64 lanes holding 32-bit values: exact on every device."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def gumbel(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, a pure function of (key, token); broadcasts."""
    bits = hash32_(keys ^ tokens).bitwise_right_shift_(9)
    # (23-bit integer + 0.5) * 2**-23 needs 24 significant bits: exact in float32, strictly in (0, 1).
    uniform = bits.float().add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_()


# The noise lies in [-2.81, 16.64] (uniforms in [2**-24, 1 - 2**-24]); 21 leaves room for rounding.
_NOISE_SPREAD = 21.0


def add_noise(scaled: torch.Tensor, keys: torch.Tensor, prune: bool) -> torch.Tensor:
    """scaled [B, V] + every token's noise. Pruned: a token more than the noise's spread
    below its row's max cannot win the race, so it gets -inf instead of hashed noise:
    the same argmax, and on CPU, where hashing dominates, much less hashing when most
    tokens are out of reach. Not on GPUs: hashing all is cheap there and a
    data-dependent shape would cost a sync."""
    if prune:
        can_win = scaled >= scaled.amax(dim=-1, keepdim=True) - _NOISE_SPREAD
        if 4 * int(can_win.sum()) < can_win.numel():
            rows, tokens = can_win.nonzero(as_tuple=True)
            scores = torch.full_like(scaled, -torch.inf)
            scores[rows, tokens] = scaled[rows, tokens] + gumbel(keys[rows], tokens)
            return scores
    tokens = torch.arange(scaled.shape[-1], device=scaled.device)
    return scaled + gumbel(keys[:, None], tokens[None, :])


class Sampler:
    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[Sampling], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V] -> host (token ids [N], logprobs [N] under the unscaled distribution)."""
        packed = self.sample_packed(logits, params, positions).cpu()
        return packed[:, 0].long(), packed[:, 1].float()

    def sample_packed(self, logits: torch.Tensor, params: list[Sampling], positions: list[int]) -> torch.Tensor:
        """[N, 2] float64 on the logits' device: token id, logprob."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        if any(p.temperature > 0 for p in params):
            rows, filter_rows = self._row_params(params, positions, logits.shape[-1], logits.device)
            tokens = torch.where(rows[:, _GREEDY] > 0, tokens, _sample(logits, rows, filter_rows))
        # logsumexp instead of log_softmax: one reduction, no [N, vocab] output.
        logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return torch.stack([tokens.double(), logprobs.double()], dim=1)

    def _row_params(
        self, params: list[Sampling], positions: list[int], vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-row parameter block and the rows to filter, in one host->device copy."""
        n = len(params)
        temp = np.array([p.temperature for p in params], dtype=np.float64)
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        seeded = np.array([p.seed is not None for p in params])
        seeds = np.array([(p.seed or 0) & (2**64 - 1) for p in params], dtype=np.uint64)
        keys = np.where(
            seeded,
            row_keys(seeds, np.array(positions, dtype=np.uint64)),
            self.rng.integers(0, 2**32, size=n, dtype=np.uint64),
        )
        greedy = temp <= 0
        top_k = np.where((top_k > 0) & ~greedy, top_k, vocab)
        top_p = np.where((top_p > 0) & (top_p < 1) & ~greedy, top_p, 1.0)
        filter_rows = np.flatnonzero((top_k < vocab) | (top_p < 1))
        block = np.empty(n * _NCOLS + len(filter_rows), dtype=np.float64)
        block[: n * _NCOLS] = np.stack([np.where(greedy, 1.0, temp), greedy, top_k, top_p, keys], axis=1).ravel()
        block[n * _NCOLS :] = filter_rows
        host = torch.from_numpy(block)
        if device.type == "cuda":
            host = host.pin_memory()
        on_device = host.to(device, non_blocking=True)
        return on_device[: n * _NCOLS].view(n, _NCOLS), on_device[n * _NCOLS :].long()


def _sample(logits: torch.Tensor, rows: torch.Tensor, filter_rows: torch.Tensor) -> torch.Tensor:
    scaled = logits / rows[:, _TEMP, None].float()
    scores = add_noise(scaled, rows[:, _KEY].long(), prune=logits.device.type == "cpu")
    if filter_rows.numel():
        dropped = ~_keep_mask(scaled[filter_rows], rows[filter_rows])
        scores[filter_rows] = scores[filter_rows].masked_fill(dropped, -torch.inf)
    return scores.argmax(dim=-1)


def _keep_mask(scaled: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Top-k and top-p over softmax(scaled), one sort for every row that filters."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    # Keep a token while the mass before it is < p: the top token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < rows[:, _TOP_K, None]) & (mass_before < rows[:, _TOP_P, None].float())
    return torch.zeros_like(keep).scatter_(1, order, keep)
