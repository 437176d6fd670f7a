"""The model's vocabulary as the grammar engine sees it: llguidance's token
trie built from the `tokenizers` JSON (no transformers, no torch), the EOS ids
a finished grammar allows, and the width of a token mask.

Mask layout, the one rule the worker applies (bitmask.py is its reference):
row r of a mask is `mask_words` int32 words; bit b of word w allows token id
32*w + b. The width covers the model's logits, which may be wider than the
tokenizer's vocabulary (padded embeddings): those extra ids are never allowed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import llguidance
from tokenizers import Tokenizer

from scheduler_svc.text.tokenizer import ModelTokenizer


def mask_words(vocab_size: int) -> int:
    """int32 words of one mask row covering `vocab_size` token ids."""
    return (vocab_size + 31) // 32


class GrammarVocab:
    def __init__(self, tokenizer_json: str, logits_width: int, eos_token_ids: Iterable[int]) -> None:
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        if not self.eos_token_ids:
            raise ValueError("a grammar needs the model's EOS ids to end on")
        # ids past the logits never get sampled; ids past the tokenizer are never allowed
        tokenizer_size = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(logits_width, tokenizer_size)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
        )
        self.mask_words = mask_words(self.vocab_size)
        digest = hashlib.sha256(tokenizer_json.encode())
        digest.update(f"|{self.vocab_size}|{self.eos_token_ids}".encode())
        self.key = digest.hexdigest()[:16]  # a compiled grammar belongs to one vocabulary

    @classmethod
    def from_model_tokenizer(cls, tokenizer: ModelTokenizer) -> GrammarVocab:
        return cls(tokenizer.tokenizer.to_str(), tokenizer.vocab_size, tokenizer.eos_token_ids)

    def encode(self, text: str) -> list[int]:
        """The tokens of `text` as the grammar engine splits it (tests and benchmarks walk with them)."""
        return self.tokenizer.tokenize_str(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode_str(token_ids)
