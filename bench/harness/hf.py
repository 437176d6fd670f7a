"""The reference a benchmark compares pagedserve with: transformers' generate over a
static batch (left padding), exactly max_tokens new tokens a row."""

from __future__ import annotations

from typing import Any


def left_padded(prompts: list[list[int]], pad_id: int, device: str | None = None) -> tuple[Any, Any]:
    """The prompts as one batch for transformers' generate, padded on the left (each
    row's prompt ends in the last column): input ids and attention mask."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return input_ids, attention_mask


def generate_exactly(model: Any, input_ids: Any, attention_mask: Any, max_tokens: int, pad_id: int) -> Any:
    """transformers' greedy generate, exactly max_tokens new tokens a row (no early
    stop at EOS): the new tokens, [rows, max_tokens]."""
    import torch

    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return out[:, input_ids.shape[1] :]
