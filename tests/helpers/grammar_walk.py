"""Grammar vocabularies of the default model and of the tiny checkpoints'
tokenizer (trained in-process, no torch), and random walks through the
tokens a grammar allows: what a model with random weights would emit under
the mask alone."""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from scheduler_svc.structured import GrammarMatcher, GrammarVocab, allowed_ids
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import DEFAULT_MODEL

TINY_EOS = 2  # <|im_end|> (tools/tiny_checkpoints.py: special tokens are ids 0..3)
# Past this many steps a walk prefers tokens that close strings, arrays and
# objects, so walks through unbounded numbers and free text end.
CLOSING_AFTER = 60
CLOSING = set('"]},@')  # '@': an email-format string closes only after its domain


@functools.cache
def default_vocab() -> GrammarVocab:
    return GrammarVocab.from_model_tokenizer(load_tokenizer(DEFAULT_MODEL))


@functools.cache
def tiny_vocab(logits_width: int = 768) -> GrammarVocab:
    from tools.tiny_tokenizer import train_tokenizer_json

    return GrammarVocab(train_tokenizer_json(), logits_width, [TINY_EOS])


@dataclass
class Walk:
    tokens: list[int]
    text: str
    ended_by: str  # "complete": the grammar allows nothing more; "eos": EOS sampled where allowed


def random_walk(matcher: GrammarMatcher, rng: random.Random, max_steps: int = 1500) -> Walk:
    """Sample uniformly among the allowed ids until the grammar completes or EOS is drawn."""
    vocab = matcher.vocab
    eos = set(vocab.eos_token_ids)
    tokens: list[int] = []
    for step in range(max_steps):
        if matcher.is_complete:
            return Walk(tokens, vocab.decode(tokens), "complete")
        allowed = allowed_ids(matcher.mask(), vocab.vocab_size)
        assert len(allowed) > 0, f"empty mask after {vocab.decode(tokens)!r}"
        refused = [int(t) for t in allowed[:: max(1, len(allowed) // 16)] if not matcher.allows(int(t))]
        assert not refused, f"mask allows {refused} that advance refuses after {vocab.decode(tokens)!r}"
        token = _pick(allowed, vocab, rng, prefer_closing=step >= CLOSING_AFTER)
        if token in eos:
            assert matcher.can_end
            return Walk(tokens, vocab.decode(tokens), "eos")
        matcher.advance(token)
        tokens.append(token)
    raise AssertionError(f"no end after {max_steps} tokens: {vocab.decode(tokens)!r}")


def _pick(allowed: np.ndarray, vocab: GrammarVocab, rng: random.Random, prefer_closing: bool) -> int:
    if prefer_closing:
        closing = allowed[_closing_ids(vocab)[allowed]]
        if len(closing):
            return int(rng.choice(closing))
    return int(rng.choice(allowed))


_CLOSING_IDS: dict[str, np.ndarray] = {}


def _closing_ids(vocab: GrammarVocab) -> np.ndarray:
    """[vocab_size] bool: the token's text has a closing character."""
    if vocab.key not in _CLOSING_IDS:
        texts = [vocab.decode([t]) for t in range(vocab.vocab_size)]
        _CLOSING_IDS[vocab.key] = np.array([bool(CLOSING & set(text)) for text in texts])
    return _CLOSING_IDS[vocab.key]
