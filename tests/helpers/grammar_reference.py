"""transformers' greedy search under a grammar's mask: the oracle of the structured-output
exactness tests (the grammar engine's numpy mask applied by a logits processor)."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from scheduler_svc.structured import Constraint, GrammarMatcher, apply_bitmask
from tests.helpers.cluster import hf_greedy


class GrammarMask(LogitsProcessor):
    """The request's grammar over transformers' greedy search: advanced with each token
    generated so far, its mask applied to the next token's logits."""

    def __init__(self, matcher: GrammarMatcher, prompt_len: int):
        self.matcher, self.prompt_len = matcher, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for token in input_ids[0, self.prompt_len + self.matcher.num_tokens :].tolist():
            self.matcher.advance(token)
        if not self.matcher.needs_mask:
            return scores
        return torch.from_numpy(apply_bitmask(scores.numpy(), self.matcher.mask()[None]))


def reference(model, compiler, prompt: list[int], constraint: Constraint | None, max_tokens: int) -> list[int]:
    """transformers' greedy tokens under the mask, up to where the scheduler ends the request:
    the token that completes the grammar (the EOS it would force is never sampled)."""
    if constraint is None:
        return hf_greedy(model, prompt, max_tokens)
    grammar = compiler.compile(constraint)
    mask = LogitsProcessorList([GrammarMask(GrammarMatcher(grammar), len(prompt))])
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, logits_processor=mask)
    tokens = out[0, len(prompt) :].tolist()
    walk = GrammarMatcher(grammar)
    for i, token in enumerate(tokens):
        walk.advance(token)
        if walk.is_complete:
            return tokens[: i + 1]
    return tokens
