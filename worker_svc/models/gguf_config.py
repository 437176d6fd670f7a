"""A GGUF file's config: transformers' reading of its metadata, corrected where llama.cpp
reads the file otherwise. The worker's spec (spec.py) and the sidecar the torch-free
services read (tools/prepare_default_model.py) both take it from here, so they agree."""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader
from transformers import AutoConfig, PretrainedConfig


def gguf_config(gguf: str | Path) -> PretrainedConfig:
    """transformers' config of a GGUF file, corrected where llama.cpp reads the file
    otherwise: a llama-architecture file whose general.name is "mistral" becomes a
    MistralConfig with its default 4,096-token sliding window, which llama.cpp's llama
    architecture never applies and Mistral v0.2+ do not have: none; a phi3 file's
    sliding window, which transformers does not read (Phi-3-mini-4k: 2,047) and
    llama.cpp applies: the file's."""
    path = Path(gguf)
    cfg: PretrainedConfig = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if cfg.model_type == "mistral":
        cfg.sliding_window = None
    if cfg.model_type == "phi3":
        window = metadata_number(GGUFReader(path), "phi3.attention.sliding_window")
        cfg.sliding_window = None if window is None else int(window)
    return cfg


def metadata_number(reader: GGUFReader, key: str) -> float | None:
    """A numeric metadata field of the file, None where it has none."""
    found = reader.fields.get(key)
    return None if found is None else float(found.parts[found.data[0]][0])
