"""Decoder families the worker runs over the paged cache, one adapter each in
families/ (registry.py): Llama, Qwen2/3, Mistral, Phi-3, Gemma 2/3, OLMo 2, Granite."""

from worker_svc.models.decoder import DecoderModel
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.spec import ModelSpec, load_spec

__all__ = ["ModelSpec", "load_spec", "DecoderModel", "UnsupportedModel"]
