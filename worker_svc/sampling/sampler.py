"""Token sampling on the logits' device: greedy, temperature, top-k, top-p.

A sample is a Gumbel race, argmax(logits / T + Gumbel noise), over the tokens
the top-k/top-p filter keeps. The noise of token t is a hash of (row key, t)
computed with integer tensor ops, and a seeded row's key is a hash of
(seed, position): the same request samples the same token at the same
position whatever else is in the batch, on any device. Unseeded rows get keys
drawn on the host each step and go through the same path.

Only one tensor crosses to the host per step: (token id, logprob) pairs as
float64 (ids < 2**53 are exact): one per sample, then the top-N alternatives of
the rows that ask for them, then the prompt logprobs (PackedLayout).

The parameters arrive as columns (params.SamplingParams) and go to the device
as one block: no Python object per row. Rows with blocked ids, a logit bias or
penalties (logits_processing.py, the rows' RowExtras) are processed in a copy
of just those rows; a batch without any does no extra work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from worker_svc.sampling.logits_processing import (
    add_logit_bias_,
    apply_penalties_,
    block_tokens_,
    mask_tokens_,
    token_counts,
)
from worker_svc.sampling.packed import Packed, PackedLayout
from worker_svc.sampling.params import PromptScoring, SamplingParams
from worker_svc.step.input import IntArray, RowExtras, UIntArray

F64Array = npt.NDArray[np.float64]

_NO_EXTRAS = RowExtras()
_M32 = 0xFFFFFFFF
# Columns of the per-row parameter block sent to the device in one copy.
_TEMP, _GREEDY, _TOP_K, _TOP_P, _KEY = range(5)
_NCOLS = 5


def row_keys(seeds: UIntArray, positions: UIntArray) -> UIntArray:
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

    def sample_packed(self, logits: torch.Tensor, params: SamplingParams) -> Packed:
        """Samples the first len(params) rows of `logits`; the rows after them are
        scored for params.prompt. Everything comes back in one device tensor (see
        PackedLayout). Logprobs are of the raw distribution (before processing,
        temperature and filtering)."""
        logits = logits.float()
        num = len(params)
        raw = logits[:num]
        processed = self._process(raw, params)
        tokens = raw.argmax(dim=-1)
        if processed is not None:
            rows, block = processed
            tokens[rows] = block.argmax(dim=-1)
        if (params.columns.temperature > 0).any():
            rows_block, filter_rows = self._row_params(params, logits.shape[-1], logits.device)
            sampled = _sample(raw, rows_block, filter_rows, processed)
            tokens = torch.where(rows_block[:, _GREEDY] > 0, tokens, sampled)
        # logsumexp instead of log_softmax: one reduction, no [N, vocab] output.
        lse = torch.logsumexp(raw, dim=-1)
        logprobs = raw.gather(1, tokens[:, None]).squeeze(1) - lse
        parts = [torch.stack([tokens.double(), logprobs.double()], dim=1)]
        top_n = params.top_logprobs
        top_rows = np.flatnonzero(top_n)
        width = int(top_n.max()) if top_rows.size else 0
        if top_rows.size:
            parts.append(_top_pairs(raw, lse, top_rows, width))
        layout = PackedLayout(num, top_rows, width)
        if (prompt := params.prompt) is not None:
            parts += self._score(logits[num:], prompt)
            prompt_top_rows = np.flatnonzero(prompt.top_n)
            prompt_width = int(prompt.top_n.max()) if prompt_top_rows.size else 0
            layout = PackedLayout(num, top_rows, width, prompt.targets.size, prompt_top_rows, prompt_width)
        return Packed(torch.cat(parts) if len(parts) > 1 else parts[0], layout)

    @staticmethod
    def _score(logits: torch.Tensor, prompt: PromptScoring) -> list[torch.Tensor]:
        """(target id, logprob) per row, then the alternatives of the rows that want them."""
        targets = torch.from_numpy(prompt.targets).to(logits.device)
        lse = torch.logsumexp(logits, dim=-1)
        logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse
        parts = [torch.stack([targets.double(), logprobs.double()], dim=1)]
        top_rows = np.flatnonzero(prompt.top_n)
        if top_rows.size:
            parts.append(_top_pairs(logits, lse, top_rows, int(prompt.top_n.max())))
        return parts

    def _process(self, logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, their processed logits [R, V]) for the rows with a token mask, blocked
        ids, a logit bias or penalties; None (and no work at all) when no row has any."""
        masks = params.token_masks() if params.token_masks is not None else None
        rows = sorted(
            {row for row, e in params.extras.items() if e.processes_logits}.union(
                [] if masks is None else masks.rows.tolist()
            )
        )
        if not rows:
            return None
        inputs = _processing_inputs([params.extras.get(i, _NO_EXTRAS) for i in rows], rows)
        on_device = _to_device(inputs.block, logits.device)
        part = dict(zip(inputs.names, torch.split(on_device, inputs.sizes)))
        rows_t = part["rows"].long()
        block = logits[rows_t]  # a copy: the raw logits stay for the logprobs
        if masks is not None and len(masks):  # first: nothing processed may revive a token the mask forbids
            local = torch.from_numpy(np.searchsorted(rows, masks.rows)).to(logits.device)
            mask_tokens_(block, local, _to_device(masks.words, logits.device))
        block_tokens_(block, part["blocked_rows"].long(), part["blocked_ids"].long())
        add_logit_bias_(block, part["bias_rows"].long(), part["bias_ids"].long(), part["bias_values"])
        if inputs.penalized.size:
            self._penalize(block, inputs, part, params.input_ids)
        return rows_t, block

    @staticmethod
    def _penalize(
        block: torch.Tensor,
        inputs: _ProcessingInputs,
        part: dict[str, torch.Tensor],
        input_ids: Callable[[], torch.Tensor] | None,
    ) -> None:
        """Penalties on the penalized rows of `block` (all rows of one [P, V] sub-block)."""
        penalized = part["penalized"].long()
        num, vocab = inputs.penalized.size, block.shape[-1]
        out_rows, out_ids = part["output_rows"].long(), part["output_ids"].long()
        if inputs.counts_input.size:
            if input_ids is None:
                raise ValueError("a penalty counts the input token, but no input ids were given")
            sample_rows = part["counts_input_samples"].long()
            out_rows = torch.cat([out_rows, part["counts_input"].long()])
            out_ids = torch.cat([out_ids, input_ids()[sample_rows]])
        counts = token_counts(num, vocab, out_rows, out_ids)
        seen = torch.zeros(num, vocab, dtype=torch.bool, device=block.device)
        seen[part["prompt_rows"].long(), part["prompt_ids"].long()] = True
        factors = part["factors"].view(num, 3).float()
        sub = block[penalized]
        apply_penalties_(sub, counts, seen, factors[:, 0], factors[:, 1], factors[:, 2])
        block[penalized] = sub

    def _row_params(
        self, params: SamplingParams, vocab: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-row parameter block and the rows to filter, in one host->device copy."""
        c = params.columns
        n = len(params)
        temp = c.temperature.astype(np.float64)
        keys = np.where(
            c.seeded,
            row_keys(c.seeds, params.positions.astype(np.uint64)),
            self.rng.integers(0, 2**32, size=n, dtype=np.uint64),
        )
        greedy = temp <= 0
        top_k = np.where((c.top_k > 0) & ~greedy, c.top_k, vocab)
        top_p = np.where((c.top_p > 0) & (c.top_p < 1) & ~greedy, c.top_p.astype(np.float64), 1.0)
        filter_rows = np.flatnonzero((top_k < vocab) | (top_p < 1))
        block = np.empty(n * _NCOLS + len(filter_rows), dtype=np.float64)
        block[: n * _NCOLS] = np.stack([np.where(greedy, 1.0, temp), greedy, top_k, top_p, keys], axis=1).ravel()
        block[n * _NCOLS :] = filter_rows
        on_device = _to_device(block, device)
        return on_device[: n * _NCOLS].view(n, _NCOLS), on_device[n * _NCOLS :].long()


def _sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    filter_rows: torch.Tensor,
    processed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    temperature = rows[:, _TEMP, None].float()
    scaled = logits / temperature
    if processed is not None:
        processed_rows, block = processed
        scaled[processed_rows] = block / temperature[processed_rows]
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


def _top_pairs(logits: torch.Tensor, lse: torch.Tensor, rows: IntArray, n: int) -> torch.Tensor:
    """[len(rows) * n, 2]: each row's n most likely (token id, logprob), most likely first."""
    index = torch.from_numpy(rows).to(logits.device)
    values, ids = logits[index].topk(n, dim=-1)
    logprobs = values - lse[index, None]
    return torch.stack([ids.double(), logprobs.double()], dim=-1).view(-1, 2)


def _to_device(block: F64Array | npt.NDArray[np.int32], device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(block)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True, slots=True)
class _ProcessingInputs:
    """The processed rows' inputs as flat float64 segments of one block (ids < 2**53
    are exact), so they reach the device in one copy."""

    names: tuple[str, ...]
    sizes: list[int]
    block: F64Array
    penalized: IntArray  # rows (of the processed block) with penalties
    counts_input: IntArray  # of those, the ones that count their input token


def _flat(lists: Sequence[Sequence[float]], rows: IntArray) -> tuple[F64Array, F64Array]:
    """(row of each entry, the entries) of per-row lists laid end to end."""
    lens = np.array([len(x) for x in lists], dtype=np.int64)
    values = np.concatenate([np.asarray(x, dtype=np.float64) for x in lists]) if lists else np.zeros(0)
    return np.repeat(rows, lens).astype(np.float64), values


def _processing_inputs(extras: list[RowExtras], sample_rows: list[int]) -> _ProcessingInputs:
    everyone = np.arange(len(extras))
    blocked_rows, blocked_ids = _flat([p.blocked_token_ids for p in extras], everyone)
    bias_rows, bias_ids = _flat([p.logit_bias_token_ids for p in extras], everyone)
    _, bias_values = _flat([p.logit_bias_values for p in extras], everyone)
    penalties = [p.penalties for p in extras]
    penalized = np.array([i for i, p in enumerate(penalties) if p is not None], dtype=np.int64)
    chosen = [penalties[i] for i in penalized]  # rows of the [P, V] penalized sub-block, in this order
    local = np.arange(len(chosen))
    output_rows, output_ids = _flat([p.output_token_ids for p in chosen], local)
    prompt_rows, prompt_ids = _flat([p.prompt_token_ids for p in chosen], local)
    factors = np.array([(p.presence, p.frequency, p.repetition) for p in chosen], dtype=np.float64).ravel()
    counts_input = np.array([k for k, p in enumerate(chosen) if p.count_input_token], dtype=np.int64)
    counts_input_samples = np.array([sample_rows[penalized[k]] for k in counts_input], dtype=np.int64)
    segments = {
        "rows": np.asarray(sample_rows, dtype=np.float64),
        "blocked_rows": blocked_rows,
        "blocked_ids": blocked_ids,
        "bias_rows": bias_rows,
        "bias_ids": bias_ids,
        "bias_values": bias_values,
        "penalized": penalized.astype(np.float64),
        "output_rows": output_rows,
        "output_ids": output_ids,
        "prompt_rows": prompt_rows,
        "prompt_ids": prompt_ids,
        "factors": factors,
        "counts_input": counts_input.astype(np.float64),
        "counts_input_samples": counts_input_samples.astype(np.float64),
    }
    return _ProcessingInputs(
        tuple(segments),
        [v.size for v in segments.values()],
        np.concatenate(list(segments.values())),
        penalized,
        counts_input,
    )
