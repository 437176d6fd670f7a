"""What the worker needs to know about a checkpoint, read from its config.json.

Every family runs the one decoder forward (decoder.py); how a family differs from
Llama is a handful of switches here, set by its adapter (families/). A config
field that changes the math is either read by the family (its `honours`) or has
its neutral value; anything else is refused at load naming the field and value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from svc_common.gguf_sidecar import is_gguf_path
from worker_svc.models.config_cache import cached_config
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.families import family_of
from worker_svc.models.gguf_config import gguf_config
from worker_svc.models.moe import MoeSpec
from worker_svc.models.registry import Family
from worker_svc.models.rope import RopeTable, rope_table
from worker_svc.models.wquant_config import Scheme, parse

# transformers' activation names -> the gated MLP's (models/linear.py: activate)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


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
    layer_windows: tuple[int, ...]  # sliding window per layer, 0 = full attention
    layer_rope: tuple[int, ...]  # index into ropes per layer
    ropes: tuple[RopeTable, ...]
    eos_token_ids: tuple[int, ...]
    rotary_dim: int = 0  # 0: the whole head rotates; else partial rotary (rope.py)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False  # gate, up and down biases
    norms: str = "pre"  # pre: Llama; sandwich: Gemma (also after attention/MLP); post: OLMo 2 (only after)
    qk_norm: str = ""  # head: RMSNorm per head (Qwen3, Gemma3); full: over the whole projection (OLMo 2)
    norm_offset: float = 0.0  # Gemma: weights are stored as (w - 1)
    embed_scale: float = 1.0  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_scale: float = 1.0  # Granite: residual_multiplier on each block's output
    logits_divisor: float = 1.0  # Granite: logits_scaling
    final_softcap: float = 0.0  # Gemma 2: logits = cap * tanh(logits / cap)
    attn_softcap: float = 0.0  # Gemma 2: attention scores = cap * tanh(scores / cap), in every backend's op
    moe: MoeSpec | None = None  # sparse mixture-of-experts blocks (models/moe.py)

    @property
    def sliding_window(self) -> int:
        return max(self.layer_windows)


# Config fields that change the math in some family, with their neutral value: a
# family that does not read one (its `honours`) refuses any other value.
NEUTRAL: dict[str, Any] = {
    "attention_bias": False,
    "qkv_bias": False,
    "mlp_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "use_bidirectional_attention": None,
    "use_qk_norm": False,
    "clip_qkv": None,
}


def read_config(model_dir: str | Path) -> PretrainedConfig:
    """The checkpoint's config: config.json, or a GGUF file's metadata (transformers
    reads it). A quantization_config is read by models/wquant_config.py, which
    refuses by name what is not served."""
    path = Path(model_dir)
    try:
        if is_gguf_path(path):
            cfg: PretrainedConfig = gguf_config(path)
            return cfg
        cfg = cached_config(path / "config.json", lambda: AutoConfig.from_pretrained(model_dir))
    except (ValueError, KeyError) as exc:  # a model_type transformers itself does not know
        raise UnsupportedModel(f"{path.name}: {exc}") from exc
    quant_scheme(cfg)  # refuses, naming the field, what is not served
    return cfg


def quant_scheme(cfg: PretrainedConfig) -> Scheme | None:
    """The checkpoint's quantization scheme (models/wquant_config.py), None if unquantized."""
    quant = getattr(cfg, "quantization_config", None)
    if quant is None:
        return None
    return parse(quant if isinstance(quant, dict) else quant.to_dict())


def load_spec(model_dir: str | Path) -> ModelSpec:
    cfg = read_config(model_dir)
    family = family_of(cfg.model_type)
    _refuse_unread(cfg, family)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    act_name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act_name not in ACTIVATIONS:
        raise UnsupportedModel(f"hidden_act {act_name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    params = cfg.rope_parameters or {}
    partial = float(params.get("partial_rotary_factor", 1.0)) if "rope_theta" in params else 1.0
    if partial != 1.0 and "partial_rotary_factor" not in family.honours:
        raise UnsupportedModel(f"{cfg.model_type}: rope_parameters.partial_rotary_factor {partial} is not supported")
    rotary_dim = int(head_dim * partial)
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
    rope_keys, ropes = _rope_tables(cfg, layer_types, head_dim, rotary_dim)
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    common: dict[str, Any] = dict(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_q_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_model_len=min([cfg.max_position_embeddings, *(t.max_len for t in ropes if t.max_len)]),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        activation=ACTIVATIONS[act_name],
        attention_scale=head_dim**-0.5,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in layer_types),
        layer_rope=tuple(rope_keys.index(t) if t in rope_keys else 0 for t in layer_types),
        ropes=tuple(ropes),
        eos_token_ids=_eos_ids(model_dir, cfg),
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
    )
    return ModelSpec(**{**common, **family.switches(cfg)})


def auto_dtype(resolved: str, device_type: str, model_dir: str | Path) -> str:
    """--dtype auto, given what the device prefers (`resolved`): the checkpoint's own
    torch_dtype/dtype where the device computes in it natively. On CUDA a float16
    checkpoint stays float16 (bf16 would cut 3 bits off every weight's mantissa) and
    a bfloat16 or float32 one is served in bfloat16; the CPU keeps its choice (fp16
    is not native there). A GGUF file has no config.json: its blocks are no float
    dtype to keep, so the device's choice stands."""
    if is_gguf_path(model_dir):
        return resolved
    config = json.loads((Path(model_dir) / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    if device_type == "cuda" and stored == "float16":
        return "float16"
    return resolved


def _refuse_unread(cfg: PretrainedConfig, family: Family) -> None:
    for name, neutral in NEUTRAL.items():
        value = getattr(cfg, name, neutral)
        if name in family.honours or value == neutral or (neutral in (None, False) and not value):
            continue
        raise UnsupportedModel(f"{cfg.model_type}: config field {name}={value!r} is not supported for this family")
    layer_types = set(getattr(cfg, "layer_types", None) or ())
    if layer_types - {"full_attention", "sliding_attention"}:
        raise UnsupportedModel(f"{cfg.model_type}: config field layer_types={sorted(layer_types)!r} is not supported")


def _rope_tables(
    cfg: PretrainedConfig, layer_types: list[str], head_dim: int, rotary_dim: int
) -> tuple[list[str], list[RopeTable]]:
    params = cfg.rope_parameters
    # Gemma3 keys its rope parameters by layer type; the others have one set.
    if isinstance(params, dict) and "rope_theta" not in params:
        keys = sorted(set(layer_types))
        return keys, [rope_table(params[k], head_dim, rotary_dim, cfg.max_position_embeddings) for k in keys]
    return ["*"], [rope_table(params, head_dim, rotary_dim, cfg.max_position_embeddings)]


def _eos_ids(model_dir: str | Path, cfg: PretrainedConfig) -> tuple[int, ...]:
    from transformers import GenerationConfig

    if is_gguf_path(model_dir):  # no generation config in a GGUF: the metadata's eos
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
