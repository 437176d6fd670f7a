"""Incremental detokenization: UTF-8 never split, stop strings held back and cut."""

from __future__ import annotations

import pytest

from scheduler_svc.text.detokenizer import IncrementalDetokenizer
from scheduler_svc.text.tokenizer import load_tokenizer
from tests.helpers.checkpoints import tiny_checkpoint


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_checkpoint("llama"))


def stream(tokenizer, text: str, stop=()) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer.for_prompt(tokenizer, tokenizer.encode("Prompt:"), tuple(stop))
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces, detok


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo wörld 你好 🙂 ok"
    ids = tokenizer.encode(text)
    # The tiny tokenizer has no merges for CJK or emoji: they arrive byte by byte.
    assert len(ids) > len(text.split())
    pieces, _ = stream(tokenizer, text)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_is_cut_and_nothing_after_it_is_emitted(tokenizer):
    pieces, detok = stream(tokenizer, "The weather today is sunny and warm. Tomorrow rain.", stop=["and warm"])
    assert detok.stopped
    assert "".join(pieces) == "The weather today is sunny "


def test_the_stop_string_that_cut_the_text_is_named_the_earliest_of_several(tokenizer):
    text = "The weather today is sunny and warm. Tomorrow rain."
    # Whichever the text reaches first ends it and is named, in either order of the list.
    for stop in (["and warm", "sunny and"], ["sunny and", "and warm"]):
        pieces, detok = stream(tokenizer, text, stop=stop)
        assert detok.matched == "sunny and" and "".join(pieces) == "The weather today is "
    _, unmatched = stream(tokenizer, text, stop=["snow"])
    assert unmatched.matched is None and not unmatched.stopped


def test_text_that_only_starts_like_a_stop_string_is_released(tokenizer):
    pieces, detok = stream(tokenizer, "sun and sand", stop=["sandwich"])
    assert not detok.stopped
    assert "".join(pieces) == tokenizer.decode(tokenizer.encode("sun and sand"))


def _windowed_text(tokenizer, context: list[int], ids: list[int]) -> str:
    """The text a two-window incremental decoder releases (vLLM's classic scheme):
    decode [prefix, read) and [prefix, end), keep the difference once it does not
    end in U+FFFD. The streaming detokenizer must release the same text."""
    all_ids, prefix, read, text = list(context), 0, len(context), ""
    for token in ids:
        all_ids.append(token)
        before = tokenizer.decode(all_ids[prefix:read])
        full = tokenizer.decode(all_ids[prefix:])
        if len(full) > len(before) and not full.endswith("\ufffd"):
            text += full[len(before) :]
            prefix, read = read, len(all_ids)
    return text


@pytest.mark.parametrize("seed", range(20))
def test_random_ids_release_what_windowed_decoding_releases(seed):
    """The default model's byte-level vocabulary, random ids (lone UTF-8 lead and
    continuation bytes, special tokens included) after a random prompt."""
    import random

    from tests.helpers.checkpoints import DEFAULT_MODEL

    tokenizer = load_tokenizer(DEFAULT_MODEL)
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
    ids = [rng.randrange(vocab) if rng.random() < 0.7 else rng.randrange(40) for _ in range(60)]
    detok = IncrementalDetokenizer.for_prompt(tokenizer, prompt, ())
    released = "".join(detok.add(t) for t in ids)
    assert released == _windowed_text(tokenizer, prompt[-5:], ids)
