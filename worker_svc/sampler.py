"""Token sampling: greedy, temperature, top-k, top-p, vectorized over the batch.

Randomness comes from an exponential race (argmax of p / Exp(1) noise draws one
token with probability p). A seeded sequence draws its noise from a generator
seeded by (seed, position), so the stateless worker samples the same token for
the same request at the same position, whatever else is in the batch.
"""

from __future__ import annotations

import torch

from worker_svc.step_input import Sampling

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby positions get unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[Sampling], positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, V] fp32 -> (token ids [N], logprobs [N] under the unscaled distribution)."""
        logits = logits.float().cpu()
        greedy = logits.argmax(dim=-1)
        tokens = greedy.clone()
        random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
        if random_rows:
            rows = torch.tensor(random_rows)
            chosen = self._sample_rows(
                logits[rows], [params[i] for i in random_rows], [positions[i] for i in random_rows]
            )
            tokens[rows] = chosen
        # logsumexp instead of log_softmax: one reduction, no [N, vocab] output.
        logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        return tokens, logprobs

    def _sample_rows(self, logits: torch.Tensor, params: list[Sampling], positions: list[int]) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params])[:, None]
        probs = torch.softmax(logits / temperature, dim=-1)
        probs = _top_k_top_p(probs, [p.top_k for p in params], [p.top_p for p in params])
        noise = torch.empty_like(probs)
        for i, (p, pos) in enumerate(zip(params, positions)):
            gen = self.generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(position_seed(p.seed, pos))
            noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    if all(k <= 0 for k in top_k) and all(p <= 0 or p >= 1 for p in top_p):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    k = torch.tensor([k if k > 0 else vocab for k in top_k])[:, None]
    p = torch.tensor([p if 0 < p < 1 else 1.0 for p in top_p])[:, None]
    rank = torch.arange(vocab)[None, :]
    # Keep a token while the mass before it is < p: the top token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < k) & (mass_before < p)
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return filtered
