"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p.

A sample is a Gumbel race, argmax(logits / T + Gumbel noise), over the tokens
the filters keep: min-p, then top-k/top-p, as one cut on the scaled logits per
row (_thresholds). The noise of token t is a hash of (row key, t), and a seeded
row's key is a hash of (seed, position): the same request samples the same
token at the same position whatever else is in the batch, on any device. The
race itself is kernels' gumbel_argmax: the fused Triton kernel on CUDA (one pass
over the logits), the torch reference elsewhere. Unseeded rows get keys drawn
on the host each step and go through the same path.

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

from kernels import cpu_ops, reference
from worker_svc.sampling.logits_processing import (
    add_logit_bias_,
    apply_penalties_,
    block_tokens_,
    mask_tokens_,
    token_counts,
)
from worker_svc.sampling.packed import Packed, PackedLayout
from worker_svc.sampling.params import LogprobIndices, PromptScoring, SamplingParams
from worker_svc.step.input import IntArray, RowExtras, UIntArray

F64Array = npt.NDArray[np.float64]

_NO_EXTRAS = RowExtras()

# Columns of the per-row parameter block sent to the device in one copy.
_TEMP, _GREEDY, _TOP_K, _TOP_P, _MIN_P, _KEY = range(6)
_NCOLS = 6
GumbelArgmax = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def row_keys(seeds: UIntArray, positions: UIntArray) -> UIntArray:
    """splitmix64 of (seed, position) in uint64 (numpy wraps by definition), top 32 bits."""
    with np.errstate(over="ignore"):
        z = seeds * np.uint64(0x9E3779B97F4A7C15) + positions + np.uint64(1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) >> np.uint64(32)


def device_gumbel_argmax(device: torch.device) -> GumbelArgmax:
    """The Gumbel race for logits on `device`: the fused Triton kernel on CUDA (one
    pass over the logits), the torch reference elsewhere; the same tokens."""
    if device.type == "cuda":
        from kernels.triton.sampling import gumbel_argmax  # imported lazily: triton is heavy and optional on CPU

        return gumbel_argmax
    return reference.gumbel_argmax


class Sampler:
    def __init__(self, seed: int | None = None, gumbel_argmax: GumbelArgmax | None = None):
        """`gumbel_argmax`: the race's implementation; None = device_gumbel_argmax
        of the logits' device (tests pass the Triton one under the interpreter)."""
        self.rng = np.random.default_rng(seed)
        self.gumbel_argmax = gumbel_argmax

    def sample_packed(self, logits: torch.Tensor, params: SamplingParams) -> Packed:
        """Samples the first len(params) rows of `logits`; the rows after them are
        scored for params.prompt. Everything comes back in one device tensor (see
        PackedLayout). Logprobs are of the raw distribution (before processing,
        temperature and filtering)."""
        logits = logits.float()
        num = len(params)
        raw = logits[:num]
        processed = self._process(raw, params)
        tokens, lse = cpu_ops.argmax_logsumexp(raw)  # lse: of the raw logits, for every logprob below
        if processed is not None:
            rows, block = processed
            tokens[rows] = block.argmax(dim=-1)
        if (params.columns.temperature > 0).any():
            rows_block, filter_rows, min_p_rows = self._row_params(params, logits.shape[-1], logits.device)
            race = self.gumbel_argmax or device_gumbel_argmax(logits.device)
            sampled = _sample(raw, rows_block, filter_rows, min_p_rows, processed, race)
            tokens = torch.where(rows_block[:, _GREEDY] > 0, tokens, sampled)
        logprobs = raw.gather(1, tokens[:, None]).squeeze(1) - lse
        parts = [torch.stack([tokens.double(), logprobs.double()], dim=1)]
        if not params.asks_logprob_indices:
            return Packed(parts[0], PackedLayout(num, np.zeros(0, dtype=np.int64), 0))
        indices = params.indices or LogprobIndices.of(params, logits.device)
        top_n = params.top_logprobs
        top_rows = np.flatnonzero(top_n)
        width = int(top_n.max()) if top_rows.size else 0
        if top_rows.size:
            parts.append(_top_pairs(raw, lse, indices.top_rows, width))
        layout = PackedLayout(num, top_rows, width)
        if (prompt := params.prompt) is not None:
            parts += self._score(logits[num:], prompt, indices)
            prompt_top_rows = np.flatnonzero(prompt.top_n)
            prompt_width = int(prompt.top_n.max()) if prompt_top_rows.size else 0
            layout = PackedLayout(num, top_rows, width, prompt.targets.size, prompt_top_rows, prompt_width)
        return Packed(torch.cat(parts), layout)

    @staticmethod
    def _score(logits: torch.Tensor, prompt: PromptScoring, indices: LogprobIndices) -> list[torch.Tensor]:
        """(target id, logprob) per row, then the alternatives of the rows that want them."""
        targets = indices.prompt_targets
        _, lse = cpu_ops.argmax_logsumexp(logits)
        logprobs = logits.gather(1, targets[:, None]).squeeze(1) - lse
        parts = [torch.stack([targets.double(), logprobs.double()], dim=1)]
        if indices.prompt_top_rows.numel():
            parts.append(_top_pairs(logits, lse, indices.prompt_top_rows, int(prompt.top_n.max())))
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The per-row parameter block, the rows that filter by top-k/top-p and the
        rows that filter by min-p, in one host->device copy."""
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
        min_p = np.where(~greedy, c.min_p.astype(np.float64), 0.0)
        filter_rows = np.flatnonzero((top_k < vocab) | (top_p < 1))
        min_p_rows = np.flatnonzero(min_p > 0)
        columns = [np.where(greedy, 1.0, temp), greedy, top_k, top_p, min_p, keys]
        block = np.concatenate([np.stack(columns, axis=1).ravel(), filter_rows, min_p_rows]).astype(np.float64)
        on_device = _to_device(block, device)
        rows, filters, min_ps = torch.split(on_device, [n * _NCOLS, len(filter_rows), len(min_p_rows)])
        return rows.view(n, _NCOLS), filters.long(), min_ps.long()


def _sample(
    logits: torch.Tensor,
    rows: torch.Tensor,
    filter_rows: torch.Tensor,
    min_p_rows: torch.Tensor,
    processed: tuple[torch.Tensor, torch.Tensor] | None,
    gumbel_argmax: GumbelArgmax,
) -> torch.Tensor:
    """The Gumbel race of every row over its processed logits, within the cut its
    filters make (_thresholds)."""
    if processed is not None:
        processed_rows, block = processed
        logits = logits.index_copy(0, processed_rows, block)
    temperature = rows[:, _TEMP].float()
    thresholds = _thresholds(logits, temperature, rows, filter_rows, min_p_rows)
    return gumbel_argmax(logits, temperature, rows[:, _KEY].long(), thresholds)


def _thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    rows: torch.Tensor,
    filter_rows: torch.Tensor,
    min_p_rows: torch.Tensor,
) -> torch.Tensor:
    """[N] the lowest scaled logit (logits / T) each row keeps; -inf: every token.

    vLLM's order: min-p first (a token stays if its probability is at least min_p
    times the top token's: scaled >= max + log(min_p)), then top-k and top-p over
    what min-p left (one sort, only of the rows that use them; a token stays while
    the mass before it is < p and its rank < k, so the top token always survives).
    A cut by value keeps every token tied with the last one kept, as vLLM's top-k."""
    cut = torch.full_like(temperature, -torch.inf)
    if min_p_rows.numel():
        top = logits[min_p_rows].amax(dim=-1) / temperature[min_p_rows]
        cut[min_p_rows] = top + torch.log(rows[min_p_rows, _MIN_P].float())
    if filter_rows.numel():
        scaled = logits[filter_rows] / temperature[filter_rows, None]
        scaled = scaled.masked_fill(scaled < cut[filter_rows, None], -torch.inf)
        sorted_logits = scaled.sort(dim=-1, descending=True).values
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep = (rank < rows[filter_rows, _TOP_K, None]) & (mass_before < rows[filter_rows, _TOP_P, None].float())
        last_kept = keep.sum(dim=-1, keepdim=True) - 1
        cut[filter_rows] = torch.maximum(cut[filter_rows], sorted_logits.gather(1, last_kept).squeeze(1))
    return cut


def _top_pairs(logits: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[len(rows) * n, 2]: each row's n most likely (token id, logprob), most likely first."""
    values, ids = logits[rows].topk(n, dim=-1)
    logprobs = values - lse[rows, None]
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
