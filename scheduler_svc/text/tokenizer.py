"""The model's tokenizer, loaded with the `tokenizers` library only (no
transformers, no torch), plus the bits of tokenizer/generation config the
scheduler needs: EOS ids and the vocabulary size. (The chat template is the
gateway's: gateway_svc/chat_template.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    vocab_size: int
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary ('' for an id it does not name)."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone, special tokens included (as logprobs show it)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: --tokenizer must be a directory with tokenizer.json")
    tokenizer = Tokenizer.from_file(str(path))
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    special = {k: _token_text(v) for k, v in tok_config.items() if k.endswith("_token") and v}
    return ModelTokenizer(
        tokenizer=tokenizer,
        eos_token_ids=frozenset(_eos_ids(model_dir, tokenizer, special)),
        vocab_size=_vocab_size(model_dir, tokenizer),
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(value: object) -> str:
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _eos_ids(model_dir: Path, tokenizer: Tokenizer, special: dict[str, str]) -> set[int]:
    # generation_config.json is what `generate` stops on; config.json and the
    # tokenizer's eos_token are fallbacks for checkpoints without one.
    for name in ("generation_config.json", "config.json"):
        eos = _read_json(model_dir / name).get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {int(eos)}
    token = special.get("eos_token")
    eos_id = tokenizer.token_to_id(token) if token else None
    return {eos_id} if eos_id is not None else set()


def _vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    return int(_read_json(model_dir / "config.json").get("vocab_size") or tokenizer.get_vocab_size())
