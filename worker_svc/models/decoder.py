"""One decoder forward over a flat batch of tokens from many sequences.

The model holds weights only; the KV cache and the per-step attention metadata
come in with each call, so the same model serves any mix of prefill chunks and
decodes in one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from worker_svc.models.layers import apply_rope, gated_mlp, rms_norm, rope_cos_sin
from worker_svc.models.linear import Linear, Projection
from worker_svc.models.spec import ModelSpec, load_spec


class Attention(Protocol):
    """The attention a forward runs per layer (worker_svc/attention/cache_attention.py):
    writes k/v [T, kv_heads, d] into the KV cache and returns the attention output
    [T, q_heads, d] of q [T, q_heads, d]."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor: ...


@dataclass
class LayerWeights:
    qkv: Projection  # q, k, v projections fused: one matmul
    o: Projection
    gate_up: Projection  # gate and up projections fused
    down: Projection
    attn_norm: torch.Tensor  # before attention
    mlp_norm: torch.Tensor  # before the MLP
    post_attn_norm: torch.Tensor | None = None  # Gemma sandwich norms
    post_mlp_norm: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class DecoderModel:
    def __init__(
        self,
        spec: ModelSpec,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Projection,
    ):
        self.spec = spec
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        self.device = embed.device
        self.inv_freqs = [torch.tensor(f, dtype=torch.float32, device=self.device) for f in spec.rope_inv_freqs]
        self.q_size = spec.num_q_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        transform: Callable[[ModelSpec, dict[str, torch.Tensor]], tuple[ModelSpec, dict[str, torch.Tensor]]]
        | None = None,
    ) -> DecoderModel:
        """`transform`: applied to the checkpoint before it reaches the device (a
        tensor-parallel rank keeps its slice, worker_svc/parallel/sharding.py)."""
        spec = load_spec(model_dir)
        tensors = _read_safetensors(Path(model_dir))
        if transform is not None:
            spec, tensors = transform(spec, tensors)
        return cls.from_tensors(spec, tensors, dtype, device)

    @classmethod
    def from_tensors(
        cls, spec: ModelSpec, tensors: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> DecoderModel:
        def take(name: str) -> torch.Tensor:
            return tensors.pop(name).to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # Norm weights stay fp32: they multiply fp32 activations in rms_norm.
            return (tensors.pop(name).float() + spec.norm_offset).to(device)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = torch.cat([take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")])
            gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
            sandwich = spec.sandwich_norm
            layers.append(
                LayerWeights(
                    qkv=Linear(qkv),
                    o=Linear(take(attn + "o_proj.weight")),
                    gate_up=Linear(gate_up),
                    down=Linear(take(mlp + "down_proj.weight")),
                    attn_norm=norm(p + "input_layernorm.weight"),
                    # Llama's "post_attention_layernorm" is the pre-MLP norm; Gemma's
                    # normalizes the attention output and has its own pre-MLP norm.
                    mlp_norm=norm(
                        p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")
                    ),
                    post_attn_norm=norm(p + "post_attention_layernorm.weight") if sandwich else None,
                    post_mlp_norm=norm(p + "post_feedforward_layernorm.weight") if sandwich else None,
                    q_norm=norm(attn + "q_norm.weight") if spec.qk_norm else None,
                    k_norm=norm(attn + "k_norm.weight") if spec.qk_norm else None,
                )
            )
        embed = take("model.embed_tokens.weight")
        lm_head = embed if spec.tie_word_embeddings or "lm_head.weight" not in tensors else take("lm_head.weight")
        return cls(spec, embed, layers, norm("model.norm.weight"), Linear(lm_head))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        spec = self.spec
        hidden = F.embedding(input_ids, self.embed)
        if spec.embed_scale != 1.0:
            hidden = hidden * torch.tensor(spec.embed_scale, dtype=self.dtype)
        rope = [rope_cos_sin(positions, inv_freq, self.dtype) for inv_freq in self.inv_freqs]
        for i, layer in enumerate(self.layers):
            cos, sin = rope[spec.layer_rope[i]]
            hidden = self._layer(i, layer, hidden, cos, sin, attention)
        return rms_norm(hidden, self.final_norm, spec.rms_norm_eps)

    def _layer(
        self,
        i: int,
        w: LayerWeights,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
    ) -> torch.Tensor:
        spec, eps = self.spec, self.spec.rms_norm_eps
        num_tokens = hidden.shape[0]
        x = rms_norm(hidden, w.attn_norm, eps)
        q, k, v = torch.split(w.qkv(x), [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_q_heads, spec.head_dim)
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if w.q_norm is not None and w.k_norm is not None:  # spec.qk_norm
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = attention(i, q, k, v, spec.layer_windows[i]).reshape(num_tokens, self.q_size)
        attn = w.o(attn)
        if w.post_attn_norm is not None:
            attn = rms_norm(attn, w.post_attn_norm, eps)
        hidden = hidden + attn
        mlp = gated_mlp(rms_norm(hidden, w.mlp_norm, eps), w.gate_up, w.down, spec.activation)
        if w.post_mlp_norm is not None:
            mlp = rms_norm(mlp, w.post_mlp_norm, eps)
        return hidden + mlp

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the selected hidden rows."""
        return self.lm_head(hidden).float()


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors
