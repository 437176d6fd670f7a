"""Tiny GGUF files written with the gguf package's writer: random blocks in a chosen
format for every linear weight (random bytes are valid blocks; the scales are finite,
tests/helpers/gguf_blocks.py), fp32 norms, a byte-level vocabulary. llama by default;
qwen2 adds fp32 q, k and v biases, qwen3 q and k norms, gemma2 its sandwich norms, a
sliding window and its soft-caps (`caps`), gemma3 the norms, window and q / k norms,
phi3 fused q / k / v and gate / up and a sliding window, as llama.cpp writes them."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tests.helpers.gguf_blocks import random_block_bytes

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, VOCAB, CONTEXT = 256, 512, 2, 4, 2, 320, 256


def write_tiny_gguf(
    path: Path,
    qtype: str,
    seed: int = 0,
    tied: bool = True,
    overrides: dict[str, str] | None = None,
    architecture: str = "llama",
    token_scores: bool = False,
    head_dim: int | None = None,
    caps: tuple[float, float] = (50.0, 30.0),
    name: str | None = None,
    rope_scaling: float | None = None,
    rope_dims: int | None = None,
) -> Path:
    """`qtype` for every weight but the norms; `overrides`: GGUF tensor name suffix
    (e.g. "attn_v.weight") -> another format, as llama.cpp's mixed presets have;
    `token_scores`: the vocabulary's scores too, which transformers' GGUF tokenizer
    conversion needs (tools/prepare_default_model.py's sidecar)."""
    overrides = overrides or {}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), architecture)
    if name:
        writer.add_name(name)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    # Qwen3's heads are 128 wide whatever its width, Gemma's 256 (its default query scale)
    head_dim = head_dim or {"qwen3": 128, "gemma2": 256, "gemma3": 256}.get(architecture, HIDDEN // HEADS)
    gemma = architecture.startswith("gemma")
    writer.add_rope_dimension_count(rope_dims or head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if gemma:
        writer.add_sliding_window(32)  # the 60-token prompt passes it
    if architecture == "phi3":
        writer.add_sliding_window(128)  # transformers' config reads none: past every test prompt
        writer.add_pad_token_id(0)  # Phi3Config's default, 32000, is past this vocabulary
    if architecture == "gemma2":
        writer.add_attn_logit_softcapping(caps[0])
        writer.add_final_logit_softcapping(caps[1])
    writer.add_rope_freq_base(10000.0)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope_scaling)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    if token_scores:
        writer.add_token_scores([0.0] * VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def linear(name: str, rows: int, cols: int) -> None:
        kind = next((t for suffix, t in overrides.items() if name.endswith(suffix)), qtype)
        if kind == "F32":
            writer.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32))
            return
        data = random_block_bytes(kind, rows, cols, seed=int(rng.integers(1 << 31)))
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[kind])

    def norm(name: str, size: int = HIDDEN) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    def bias(name: str, size: int) -> None:
        writer.add_tensor(name, (0.1 * rng.standard_normal(size)).astype(np.float32))

    linear("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        if gemma:
            norm(f"blk.{i}.post_attention_norm.weight")
            norm(f"blk.{i}.post_ffw_norm.weight")
        if architecture == "phi3":  # fused, as llama.cpp writes Phi-3
            linear(f"blk.{i}.attn_qkv.weight", (HEADS + 2 * KV_HEADS) * head_dim, HIDDEN)
        else:
            linear(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
            linear(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
            linear(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        if architecture == "qwen2":
            for part, rows in (("q", HEADS * head_dim), ("k", KV_HEADS * head_dim), ("v", KV_HEADS * head_dim)):
                bias(f"blk.{i}.attn_{part}.bias", rows)
        if architecture in ("qwen3", "gemma3"):
            norm(f"blk.{i}.attn_q_norm.weight", head_dim)
            norm(f"blk.{i}.attn_k_norm.weight", head_dim)
        linear(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)
        if architecture == "phi3":  # gate, then up
            linear(f"blk.{i}.ffn_up.weight", 2 * INTERMEDIATE, HIDDEN)
        else:
            linear(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
            linear(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        linear(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    norm("output_norm.weight")
    if not tied:
        linear("output.weight", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
