"""Tiny checkpoints (generated on first use) and the default model's directory."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.procs import REPO

DEFAULT_MODEL = REPO / "models" / "SmolLM2-135M-Instruct"
TINY_FAMILIES = ("llama", "llama_mqa", "llama_long", "qwen3", "qwen3_mqa", "gemma3", "gemma3_mqa")
# The other dense families (tools/tiny_checkpoints.py: DENSE_FAMILIES), tested by
# tests/integration/test_model_families.py and the chunked-prefill test.
DENSE_FAMILIES = ("llama_bias", "qwen2", "mistral", "phi3", "gemma2", "olmo2", "granite")


def tiny_checkpoint(family: str) -> Path:
    from tools.tiny_checkpoints import ensure_checkpoint

    return ensure_checkpoint(family)


# Mixture of experts (tools/tiny_checkpoints.py: MOE_FAMILIES), tested by
# tests/integration/test_moe_families.py and the chunked-prefill test.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def tiny_adapter(family: str, adapter: str) -> Path:
    """A PEFT LoRA adapter (tools/tiny_adapters.py: ADAPTERS) for the tiny `family`."""
    from tools.tiny_adapters import ensure_adapter

    return ensure_adapter(family, adapter)
