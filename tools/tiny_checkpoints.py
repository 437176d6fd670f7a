"""Tiny random-weight Hugging Face checkpoints of real architectures, built offline.

Test fixtures and benchmarks need checkpoints that exercise the same code paths as
real models (GQA/MQA, llama3 rope scaling, Qwen3 q/k norms, Gemma3 sliding-window
layers with per-layer-type rope) but load in milliseconds and need no download.

Every checkpoint shares one byte-level BPE tokenizer trained on a small corpus
(tools/tiny_tokenizer.py: ChatML special tokens and chat template). Weights are seeded per
family and drawn wider than HF's default init, so logits spread over several units
and greedy decoding does not collapse to a single token. Everything is
deterministic: two builds produce byte-identical files.

    ensure_checkpoint("gemma3")          # -> .cache/tiny_checkpoints/gemma3, built once
    verify_checkpoint(path)              # loads in transformers, greedy-generates 20 tokens
    python -m tools.tiny_checkpoints --out DIR [--family llama --family qwen3 ...]

`PAGEDSERVE_TINY_CKPT_DIR` overrides the cache root. Bump VERSION whenever the output
changes, so stale cached checkpoints are rebuilt.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.tiny_tokenizer import build_tokenizer

VERSION = "2"
MARKER = ".tiny_checkpoint_version"
DEFAULT_ROOT = Path(__file__).resolve().parent.parent / ".cache" / "tiny_checkpoints"

# --- model configs -------------------------------------------------------------

# Any: the config classes take these as typed keywords, the dict only carries them.
_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    attention_bias=False,
)


def _llama_long(ids: dict[str, Any]):
    """A long-context model for 20k-200k-token prompts: one layer, one KV head,
    so a 200,000-token cache is 2 x 1 x 1 x 16 x 4 B = 128 B per token (25 MB)."""
    from transformers import LlamaConfig

    common = {**_COMMON, "max_position_embeddings": 262144}
    return LlamaConfig(
        **common,
        **ids,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )


def _llama(ids: dict[str, Any], num_kv_heads: int, llama3_rope: bool):
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3_rope:
        # original_max_position_embeddings=64 puts the head_dim-16 wavelengths in all
        # three llama3 regimes (kept, smoothed, divided by factor).
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    return LlamaConfig(
        **_COMMON,
        **ids,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        rope_parameters=rope,
        tie_word_embeddings=llama3_rope,
    )


def _qwen3(ids: dict[str, Any], num_kv_heads: int):
    from transformers import Qwen3Config

    # 8 heads x head_dim 16 = 128 != hidden 64, as in real Qwen3 (head_dim is not hidden/heads).
    return Qwen3Config(
        **_COMMON,
        **ids,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=num_kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
    )


def _gemma3(ids: dict[str, Any], num_kv_heads: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_COMMON,
        **ids,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        # A window of 8 is far below the ~40-token prompts used in tests, so the
        # sliding layers really drop context; HF semantics: key k is visible to query q
        # iff q - 8 < k <= q.
        sliding_window=8,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        # legacy spelling of the same layer_types, kept consistent; read from **kwargs, so untyped
        sliding_window_pattern=4,  # type: ignore[call-arg]
        query_pre_attn_scalar=24,  # != head_dim, so scaling by head_dim**-0.5 is a detectable bug
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        },
        hidden_activation="gelu_pytorch_tanh",
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        tie_word_embeddings=True,
    )


def _dense(config_class: str, ids: dict[str, Any], **fields: Any):
    """A 2-layer GQA model of another dense family: its own switches in `fields`."""
    import transformers

    common = {**_COMMON, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return getattr(transformers, config_class)(**{**common, **ids, **fields})


# The rope scalings beyond default/linear/llama3 (already above), each over a short
# original context so the scaled band falls inside the tests' sequences (longrope is
# served up to its original context, 128 here: worker_svc/models/rope.py).
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64}
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    # partial_rotary_factor 0.5 of head_dim 16: 8 rotary dims, 4 factors each
    "short_factor": [1.0, 1.3, 2.1, 3.5],
    "long_factor": [1.2, 2.4, 5.0, 9.0],
    "partial_rotary_factor": 0.5,
}

DENSE_FAMILIES: dict[str, Callable[[dict[str, Any]], object]] = {
    # Biases everywhere transformers' Llama has them (attention_bias: q/k/v/o, mlp_bias:
    # gate/up/down), drawn non-zero by _randomize, with yarn rope.
    "llama_bias": lambda ids: _dense(
        "LlamaConfig", ids, attention_bias=True, mlp_bias=True, rope_parameters=_YARN, tie_word_embeddings=False
    ),
    "qwen2": lambda ids: _dense(
        "Qwen2Config", ids, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
    # A window of 8 on every layer: the tests' prompts are far longer.
    "mistral": lambda ids: _dense("MistralConfig", ids, sliding_window=8),
    "phi3": lambda ids: _dense(
        "Phi3Config", ids, original_max_position_embeddings=128, rope_parameters=dict(LONGROPE), sliding_window=None
    ),
    "gemma2": lambda ids: _dense(
        "Gemma2Config",
        ids,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        hidden_activation="gelu_pytorch_tanh",
        # Both caps well inside their ranges (scores spread over several units here,
        # real Gemma 2 caps at 50 / 30 over wider ones), so both bite.
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    ),
    "olmo2": lambda ids: _dense("Olmo2Config", ids, attention_bias=True),
    "granite": lambda ids: _dense(
        "GraniteConfig",
        ids,
        attention_bias=True,
        mlp_bias=True,
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=1.5,
    ),
}

# Mixture of experts: 8 (4) experts, top-2, routers drawn at WEIGHT_STD like every
# weight, so router logits spread over units and tokens pick different experts.
MOE_FAMILIES: dict[str, Callable[[dict[str, Any]], object]] = {
    # Layer 1 of 3 dense (mlp_only_layers), top-k weights not renormalised.
    "qwen3_moe": lambda ids: _dense(
        "Qwen3MoeConfig",
        ids,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # A shared expert (48 wide, sigmoid-gated) beside 8 routed ones (32 wide) in every
    # sparse layer; decoder_sparse_step 2 makes layers 1 and 3 of 4 sparse, 0 and 2
    # dense (64 wide); q/k/v biases (qkv_bias); top-k weights not renormalised.
    "qwen2_moe": lambda ids: _dense(
        "Qwen2MoeConfig",
        ids,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        intermediate_size=64,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
        qkv_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    # A window of 16 on every layer: below the tests' longer prompts.
    "mixtral": lambda ids: _dense(
        "MixtralConfig",
        ids,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        sliding_window=16,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
}

FAMILIES: dict[str, Callable[[dict[str, Any]], object]] = {
    "llama": lambda ids: _llama(ids, num_kv_heads=2, llama3_rope=True),
    "llama_mqa": lambda ids: _llama(ids, num_kv_heads=1, llama3_rope=False),
    "llama_long": _llama_long,
    "qwen3": lambda ids: _qwen3(ids, num_kv_heads=2),
    "qwen3_mqa": lambda ids: _qwen3(ids, num_kv_heads=1),
    "gemma3": lambda ids: _gemma3(ids, num_kv_heads=2),
    "gemma3_mqa": lambda ids: _gemma3(ids, num_kv_heads=1),
    **DENSE_FAMILIES,
    **MOE_FAMILIES,
}


def make_config(family: str, tokenizer=None):
    """The transformers config of `family`, with vocab and special ids from the tokenizer."""
    tok = tokenizer or build_tokenizer()
    ids = dict(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return FAMILIES[family](ids)


# --- weights and saving --------------------------------------------------------

WEIGHT_STD = 0.3
NORM_STD = 0.1


def _randomize(model, family: str) -> None:
    """Redraw every weight: HF's std-0.02 init gives near-uniform logits at this size."""
    import torch

    # crc32, not hash(): Python salts str hashes per process.
    gen = torch.Generator().manual_seed(zlib.crc32(family.encode()))
    # Gemma's RMSNorm multiplies by (1 + w), the others by w.
    gain_offset = -1.0 if model.config.model_type.startswith("gemma") else 0.0
    # Gemma multiplies embeddings by sqrt(hidden); undo it so the token's own embedding
    # does not dominate the residual stream.
    embed_scale = getattr(model.get_input_embeddings(), "scalar_embed_scale", 1.0)
    if model.config.model_type == "gemma2":  # scales in its forward, not its embedding module
        embed_scale = model.config.hidden_size**0.5

    def randn(shape, mean=0.0, std=1.0):
        return mean + std * torch.randn(shape, generator=gen)

    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name == "model.norm.weight":
                # Random-sign final gains stop tied embeddings from making every token
                # predict itself (E_t . E_t > 0); the scale restores logits of a few units.
                p.copy_(randn(p.shape, gain_offset, embed_scale))
            elif "norm" in name:
                p.copy_(randn(p.shape, gain_offset + 1.0, NORM_STD))
            elif "embed_tokens" in name:
                p.copy_(randn(p.shape, 0.0, WEIGHT_STD / embed_scale))
            else:
                p.copy_(randn(p.shape, 0.0, WEIGHT_STD))


def build_checkpoint(family: str, out_dir: Path) -> Path:
    """Write the checkpoint of `family` into `out_dir` (not atomic; see ensure_checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tok = build_tokenizer()
    config = make_config(family, tok)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, family)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(VERSION + "\n")
    return out_dir


def _is_current(path: Path) -> bool:
    try:
        return (path / MARKER).read_text().strip() == VERSION
    except OSError:
        return False


def ensure_checkpoint(family: str, root: Path | None = None) -> Path:
    """Return `root/family`, building it first if missing or from an older VERSION.

    Safe under concurrent callers (e.g. pytest-xdist workers): builds are serialized
    by a lock file and land by renaming a finished temp dir, so a directory carrying
    the version marker is always complete.
    """
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; choose from {sorted(FAMILIES)}")
    root = Path(root or os.environ.get("PAGEDSERVE_TINY_CKPT_DIR") or DEFAULT_ROOT)
    return build_once(root / family, lambda tmp: build_checkpoint(family, tmp), _is_current)


def build_once(target: Path, build: Callable[[Path], object], is_current: Callable[[Path], bool]) -> Path:
    """`target`, built by `build(temp dir)` unless `is_current(target)`: one builder at
    a time (a lock file beside it), landing by renaming the finished temp dir, so a
    directory that is_current accepts is always complete."""
    if is_current(target):
        return target
    root, name = target.parent, target.name
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_current(target):
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
            try:
                tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
                build(tmp)
                if target.exists():
                    stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale.", dir=root))
                    target.rename(stale / name)
                    shutil.rmtree(stale)
                tmp.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


# --- verification and CLI ------------------------------------------------------

UNICODE_SAMPLE = "héllo wörld 你好 🙂"


def verify_checkpoint(path: Path, prompt: str = "The weather today is") -> list[int]:
    """Load `path` with transformers, check keys, tokenizer round-trip and a
    non-degenerate greedy generation; return the 20 generated token ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # output_loading_info=True returns (model, info); transformers' annotation knows only the model
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model, info = loaded
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise AssertionError(f"{path}: loading problems {bad}")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(UNICODE_SAMPLE, add_special_tokens=False)["input_ids"]
    if tok.decode(ids) != UNICODE_SAMPLE or tok.unk_token_id in ids:
        raise AssertionError(f"{path}: tokenizer does not round-trip {UNICODE_SAMPLE!r}")
    inputs = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, min_new_tokens=20, do_sample=False)
    new: list[int] = out[0, inputs["input_ids"].shape[1] :].tolist()
    if len(set(new)) < 3:
        raise AssertionError(f"{path}: degenerate greedy generation {new}")
    return new


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write tiny random-weight HF checkpoints.")
    parser.add_argument("--out", type=Path, required=True, help="root directory; each family goes to OUT/NAME")
    parser.add_argument(
        "--family", action="append", choices=sorted(FAMILIES), help="family to build (repeatable; default: all)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip the transformers load/generate check")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    for family in args.family or FAMILIES:
        path = ensure_checkpoint(family, args.out)
        if args.no_verify:
            print(f"{family}: {path}")
            continue
        tok = build_tokenizer()
        print(f"{family}: {path}  greedy: {tok.decode(verify_checkpoint(path))!r}")


if __name__ == "__main__":
    main()
