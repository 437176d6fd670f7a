"""The model's tokenizer, loaded with the `tokenizers` library only (no
transformers, no torch), plus the bits of tokenizer/generation config the
scheduler needs: EOS ids and the vocabulary size. (The chat template is the
gateway's: gateway_svc/chat_template.py.)

Large inputs are tokenized and detokenized off the event loop (`encode_async`,
`decode_async`: a thread of a small pool), through the library's batch calls,
which release the GIL while Rust works (its single-text calls hold it, and stay
the fast path for small inputs): a megabyte prompt then costs its own request
time, not every stream's.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from svc_common.gguf_sidecar import model_files

# Up to this many characters (or ids) a text is handled on the event loop: a
# thread hop costs more than the work (about 1 us per character or id).
INLINE_CHARS = 8192
INLINE_IDS = 4096
OFFLOAD_THREADS = 2
TOKENIZE_NICENESS = 10  # added to the process's: below the event loop


@dataclass
class ModelTokenizer:
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    vocab_size: int
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode(); a large text in a worker thread, the GIL released while it runs."""
        if len(text) <= INLINE_CHARS:
            return self.encode(text, add_special_tokens)
        encode = functools.partial(self._encode_released, text, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._threads(), encode)

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """decode(); many ids in a worker thread, the GIL released while it runs."""
        if len(ids) <= INLINE_IDS:
            return self.decode(ids, skip_special_tokens)
        decode = functools.partial(self.tokenizer.decode_batch, [ids], skip_special_tokens=skip_special_tokens)
        texts = await asyncio.get_running_loop().run_in_executor(self._threads(), decode)
        return str(texts[0])

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        """encode() through encode_batch, which releases the GIL; the ids' list is built
        here too (a million ints is a long pause where the loop runs)."""
        (encoding,) = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        return ids

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(OFFLOAD_THREADS, thread_name_prefix="tokenize", initializer=_yield_cpu)
        return self._pool

    @property
    def longest_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (added tokens included): no token covers
        more of a text, so a prompt of more than max_model_len times this cannot fit."""
        return max(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True))

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's string in the vocabulary ('' for an id it does not name)."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def token_text(self, token_id: int) -> str:
        """One token's text decoded alone, special tokens included (as logprobs show it)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _yield_cpu() -> None:
    """A tokenizing thread runs at a lower CPU priority than the event loop (Linux nice is
    per thread): on a busy machine the streams' loop gets the core first, and a long
    prompt takes longer instead of making every stream wait."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: same priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TOKENIZE_NICENESS)


def load_tokenizer(model_dir: str | Path) -> ModelTokenizer:
    """From a model directory, or a GGUF file's extracted files (svc_common/gguf_sidecar.py)."""
    model_dir = model_files(model_dir)
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
