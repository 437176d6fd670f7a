"""Decoder families the worker runs over the paged cache: Llama, Qwen3, Gemma3 (text)."""

from worker_svc.models.decoder import DecoderModel
from worker_svc.models.spec import ModelSpec, load_spec

__all__ = ["ModelSpec", "load_spec", "DecoderModel"]
