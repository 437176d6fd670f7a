"""--model FILE.gguf for the torch-free services: the GGUF's tokenizer and chat template
extracted once (tools/prepare_default_model.py --sidecar) are what the scheduler loads
for the GGUF path, and they tokenize as the checkpoint converted from the same file."""

from __future__ import annotations

import pytest

from scheduler_svc.text.tokenizer import load_tokenizer
from svc_common.defaults import model_dir_check
from svc_common.gguf_sidecar import sidecar_dir
from tests.helpers.checkpoints import DEFAULT_MODEL
from tests.helpers.gguf_files import write_tiny_gguf
from tools.prepare_default_model import shipped_gguf, write_sidecar

GGUF = shipped_gguf()
pytestmark = pytest.mark.skipif(
    not GGUF.is_file() or not (DEFAULT_MODEL / "tokenizer.json").is_file(),
    reason="needs the shipped GGUF and `make model`",
)


def test_the_scheduler_tokenizes_a_gguf_as_its_converted_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--sidecar"):
        load_tokenizer(GGUF)  # not extracted yet: the error says how
    folder = write_sidecar(GGUF)
    assert folder == sidecar_dir(GGUF) and folder.parent == tmp_path
    assert (folder / "chat_template.jinja").is_file() or "chat_template" in (
        folder / "tokenizer_config.json"
    ).read_text()
    from_gguf, converted = load_tokenizer(str(GGUF)), load_tokenizer(DEFAULT_MODEL)
    text = "Hello there! Quantized weights, 1234 tokens: <|im_start|>user\nwhat?<|im_end|>"
    assert from_gguf.tokenizer.encode(text).ids == converted.tokenizer.encode(text).ids
    assert from_gguf.eos_token_ids == converted.eos_token_ids and from_gguf.vocab_size == converted.vocab_size
    assert model_dir_check(str(GGUF), "--model")[0]
    assert not model_dir_check(str(tmp_path / "missing.gguf"), "--model")[0]


def test_a_sidecar_written_first_by_another_process_is_kept(tmp_path, tmp_path_factory, monkeypatch):
    """Two processes extracting one GGUF at once: the second's rename finds the folder
    already whole and keeps it (os.replace onto a non-empty folder fails). Over a tiny
    GGUF: converting the shipped one's 49k-token vocabulary again took 65 s at load 10,
    and the test above extracts that one already."""
    import os

    gguf = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0", token_scores=True)
    monkeypatch.setenv("PAGEDSERVE_GGUF_CACHE", str(tmp_path))
    out = sidecar_dir(gguf)
    replace = os.replace

    def the_other_process_wins(src, dst):
        out.mkdir(parents=True)
        (out / "tokenizer.json").write_text("{}")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", the_other_process_wins)
    assert write_sidecar(gguf) == out
    assert (out / "tokenizer.json").read_text() == "{}"  # theirs, whole
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # ours removed
