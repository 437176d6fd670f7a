"""One request's position in its grammar: the mask of ids allowed next,
advanced with each sampled token, rolled back for rejected speculative
tokens, and complete when nothing but EOS may follow.

Owned by the request on the scheduler (phase B: beside its sampling options),
touched by one thread at a time: the event loop advances it with the tokens a
step reply brings; MaskFiller (fill.py) reads it on its thread while the
loop waits for the masks.

Reasoning models: with `activate_after` (the token ids that end the
reasoning, e.g. Qwen3's `</think>`) the grammar starts after them: before,
the matcher needs no mask and only watches the tokens go by."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
from numpy.typing import NDArray

from scheduler_svc.structured.compiler import CompiledGrammar, clip_error
from scheduler_svc.structured.errors import GrammarFailed, TokenRejected


class GrammarMatcher:
    def __init__(self, grammar: CompiledGrammar, activate_after: Sequence[int] = ()) -> None:
        self.grammar = grammar
        self.vocab = grammar.vocab
        self._matcher = grammar.new_matcher()
        self._eos = frozenset(self.vocab.eos_token_ids)
        self._trigger = tuple(activate_after)
        self._tokens: list[int] = []  # every token advanced over, the reasoning's included
        # index in _tokens where the grammar starts (None: still reasoning)
        self._start: int | None = None if self._trigger else 0

    @property
    def active(self) -> bool:
        """The grammar has started (always, without `activate_after`)."""
        return self._start is not None

    @property
    def needs_mask(self) -> bool:
        """The next sampled token must come from a mask."""
        return self.active and not self._matcher.is_error()

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and allows no more text: end the request
        (finish_reason stop) without sampling the EOS it would force."""
        return self.active and self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def can_end(self) -> bool:
        """The output so far satisfies the grammar (EOS is allowed next)."""
        return not self.active or self._matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the grammar failed (e.g. a lexer limit hit mid-output): the request ends with an error."""
        return clip_error(self._matcher.get_error()) if self._matcher.is_error() else None

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def fill_mask(self, out: NDArray[np.int32]) -> None:
        """Write the next token's mask into `out` ([vocab.mask_words] int32, C-contiguous)."""
        assert self.needs_mask, "no mask: the grammar has not started or has failed"
        llguidance.numpy.fill_next_token_bitmask(self._matcher, out.reshape(1, -1))

    def mask(self) -> NDArray[np.int32]:
        out = np.empty(self.vocab.mask_words, np.int32)
        self.fill_mask(out)
        return out

    def fork(self) -> GrammarMatcher:
        """An independent matcher at this position: the speculative walk through drafts
        runs on one, so a limit hit on a draft's path never fails the request's own."""
        twin = copy.copy(self)
        twin._matcher = self._matcher.deep_copy()
        twin._tokens = list(self._tokens)
        return twin

    def allows(self, token_id: int) -> bool:
        if not self.active:
            return True
        if token_id in self._eos:  # llguidance validates EOS only by consuming it
            return self._matcher.is_accepting()
        return self._matcher.validate_tokens([token_id]) == 1

    def advance(self, token_id: int) -> None:
        """Take the sampled token; TokenRejected (state unchanged) if the grammar forbids it,
        GrammarFailed if taking it hit a limit (the matcher stays failed)."""
        if self.active:
            if not self.allows(token_id):
                raise TokenRejected(token_id, self.num_tokens)
            if not self._matcher.consume_token(token_id):
                raise GrammarFailed(self.error or "the grammar failed")
        self._tokens.append(token_id)
        if not self.active and tuple(self._tokens[-len(self._trigger) :]) == self._trigger:
            self._start = len(self._tokens)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (rejected speculative tokens)."""
        assert 0 <= num_tokens <= len(self._tokens), f"rollback {num_tokens} of {len(self._tokens)} tokens"
        keep = len(self._tokens) - num_tokens
        if self._start is not None:
            in_grammar = len(self._tokens) - max(keep, self._start)
            if in_grammar and not self._matcher.rollback(in_grammar):
                raise AssertionError(f"rollback of {in_grammar} tokens failed: {self._matcher.get_error()}")
            if keep < self._start:
                self._start = None
        del self._tokens[keep:]

    @property
    def llguidance_matcher(self) -> llguidance.LLMatcher:
        """For MaskFiller's parallel fill."""
        return self._matcher
