"""What the worker needs to know about a checkpoint, read from its config.json.

Each family differs from Llama in a handful of switches; they are collected here
so the decoder has one code path (see decoder.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_TYPES = ("llama", "qwen3", "gemma3_text")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_model_len: int
    tie_word_embeddings: bool
    activation: str  # silu | gelu_tanh
    attention_scale: float
    qk_norm: bool  # Qwen3, Gemma3: RMSNorm on q and k per head
    norm_offset: float  # Gemma: weights are stored as (w - 1)
    embed_scale: float  # Gemma: embeddings times sqrt(hidden)
    sandwich_norm: bool  # Gemma: extra norms after attention and MLP
    layer_windows: tuple[int, ...]  # sliding window per layer, 0 = full attention
    layer_rope: tuple[int, ...]  # index into rope_inv_freqs per layer
    rope_inv_freqs: tuple[tuple[float, ...], ...]
    eos_token_ids: tuple[int, ...]

    @property
    def sliding_window(self) -> int:
        return max(self.layer_windows)


def rope_inv_freq(params: dict[str, Any], head_dim: int) -> list[float]:
    """Inverse RoPE frequencies for the rope types we serve: default, linear, llama3."""
    rope_type = params.get("rope_type", "default")
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")
    return inv_freq.tolist()


def _llama3_scaling(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept,
    # and the band between is interpolated smoothly.
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def read_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's config: config.json, or a GGUF file's metadata (transformers
    reads it). A quantization_config is refused by name: none is served (a GGUF
    file's blocks are, models/gguf.py)."""
    path = Path(model_dir)
    cfg: PretrainedConfig
    if path.suffix == ".gguf":
        cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        return cfg
    cfg = AutoConfig.from_pretrained(model_dir)
    quant = getattr(cfg, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        raise ValueError(
            f"config.json quantization_config (quant_method {str(method)!r}) is not served: "
            "quantized safetensors checkpoints are refused; GGUF files are served"
        )
    return cfg


def load_spec(model_dir: str | Path) -> ModelSpec:
    cfg = read_config(model_dir)
    if cfg.model_type not in SUPPORTED_TYPES:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    is_gemma = cfg.model_type == "gemma3_text"
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    rope_keys, rope_freqs = _rope_tables(cfg, layer_types, head_dim)
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    return ModelSpec(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_model_len=cfg.max_position_embeddings,
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        activation="gelu_tanh" if is_gemma else "silu",
        attention_scale=(cfg.query_pre_attn_scalar if is_gemma else head_dim) ** -0.5,
        qk_norm=cfg.model_type in ("qwen3", "gemma3_text"),
        norm_offset=1.0 if is_gemma else 0.0,
        embed_scale=cfg.hidden_size**0.5 if is_gemma else 1.0,
        sandwich_norm=is_gemma,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        layer_rope=tuple(rope_keys.index(t) if t in rope_keys else 0 for t in layer_types),
        rope_inv_freqs=tuple(tuple(f) for f in rope_freqs),
        eos_token_ids=_eos_ids(model_dir, cfg),
    )


def _rope_tables(cfg: PretrainedConfig, layer_types: list[str], head_dim: int) -> tuple[list[str], list[list[float]]]:
    params = cfg.rope_parameters
    # Gemma3 keys its rope parameters by layer type; the others have one set.
    if isinstance(params, dict) and "rope_theta" not in params:
        keys = sorted(set(layer_types))
        return keys, [rope_inv_freq(params[k], head_dim) for k in keys]
    return ["*"], [rope_inv_freq(params, head_dim)]


def _eos_ids(model_dir: str | Path, cfg: PretrainedConfig) -> tuple[int, ...]:
    from transformers import GenerationConfig

    if Path(model_dir).suffix == ".gguf":  # no generation config in a GGUF: the metadata's eos
        return _as_ids(cfg.eos_token_id)
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = cfg.eos_token_id
    return _as_ids(eos)


def _as_ids(eos: int | list[int] | None) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
