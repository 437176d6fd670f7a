"""transformers as the reference for logprobs and sampling controls: the fp32
log-softmax of every position, and greedy decoding with min_tokens, logit_bias
and the penalties written out with plain torch (vLLM's order and formulas)."""

from __future__ import annotations

from collections.abc import Iterable

LOGPROB_ATOL = 1e-3  # fp32 worker vs fp32 transformers


def position_logprobs(model, token_ids: list[int]):
    """[len, vocab]: row p is log P(next token | token_ids[: p + 1])."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def reference_greedy(
    model,
    prompt: list[int],
    max_tokens: int,
    *,
    eos_ids: Iterable[int] = (),
    ignore_eos: bool = False,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    logit_bias: dict[int, float] | None = None,
    min_tokens: int = 0,
    stop_token_ids: Iterable[int] = (),
) -> tuple[list[int], str]:
    """Greedy tokens and finish reason: blocked stop ids until min_tokens, + bias,
    repetition over prompt + generated, frequency and presence over generated."""
    import torch

    stops = set(stop_token_ids) | (set() if ignore_eos else set(eos_ids))
    out: list[int] = []
    while len(out) < max_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        if len(out) < min_tokens:
            logits[list(stops)] = -torch.inf
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
        seen = counts > 0
        seen[prompt] = True
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits) - frequency * counts - presence * (counts > 0)
        out.append(int(logits.argmax()))
        if out[-1] in stops:
            return out, "stop"
    return out, "length"
