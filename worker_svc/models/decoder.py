"""One decoder forward over a flat batch of tokens from many sequences.

The model holds weights (and the ops that multiply and normalize them, chosen at
load); the KV cache and the per-step attention metadata come in with each call, so
the same model serves any mix of prefill chunks and decodes in one pass.

The residual stream is carried as (delta, residual): each RMSNorm that follows a
residual add runs as one op with it, `ops.add_rms_norm` (kernels/reference.py's, or
a backend's fused kernel: Triton on CUDA, C++ on the CPU), and RoPE with the K/V
write is the attention callable's, one op too (`rope_write_kv`). The sums and their
order are the unfused decoder's: hidden + attn, then the norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kernels import reference
from kernels.gguf_quant import QuantizedWeight
from worker_svc.models.gguf import is_gguf, read_gguf
from worker_svc.models.layers import rms_norm, rope_cos_sin
from worker_svc.models.linear import Projection, Weight, dense, gated_linear, make_linear, place
from worker_svc.models.spec import ModelSpec, load_spec


class Attention(Protocol):
    """The attention a forward runs per layer (worker_svc/attention/cache_attention.py):
    rotates q [T, q_heads, d] and k [T, kv_heads, d] by RoPE (cos/sin [T, d]), writes
    the rotated k and v into the KV cache, and returns the attention output
    [T, q_heads, d]."""

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        window: int,
    ) -> torch.Tensor: ...


class AddRmsNorm(Protocol):
    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, /
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerOps(Protocol):
    """The fused element-wise ops the decoder runs beside attention: kernels/reference.py
    (the oracle), kernels/triton_ops.py, kernels/cpu_ops.py (an attention backend's ops)."""

    @property
    def add_rms_norm(self) -> AddRmsNorm: ...


@dataclass
class LayerWeights:
    qkv: Projection  # q, k, v projections fused: one matmul
    o: Projection
    gate_up: Projection  # act(gate) * up: the gate and up projections fused with the activation
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
        ops: LayerOps = reference,
    ):
        self.spec = spec
        self.ops = ops
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = embed.dtype
        # What the linear weights are stored as (the `worker compute` line): the dtype,
        # or a GGUF file's block formats (set by from_tensors).
        self.weight_format = str(embed.dtype).removeprefix("torch.")
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
        ops: LayerOps = reference,
        cpu_linears: bool = False,
    ) -> DecoderModel:
        """`transform`: applied to the checkpoint before it reaches the device (a
        tensor-parallel rank keeps its slice, worker_svc/parallel/sharding.py).
        `ops`: the fused element-wise ops (an attention backend's). `cpu_linears`: pack
        the weights for the C++ linear kernels on the CPU (models/linear.py)."""
        spec = load_spec(model_dir)
        if is_gguf(model_dir):
            if transform is not None:
                raise ValueError("a GGUF model is not split over ranks (tensor parallel): serve it on one worker")
            return cls.from_tensors(spec, read_gguf(model_dir, spec), dtype, device, ops, cpu_linears)
        tensors = _read_safetensors(Path(model_dir))
        if transform is not None:
            spec, tensors = transform(spec, tensors)
        weights: dict[str, Weight] = dict(tensors)
        return cls.from_tensors(spec, weights, dtype, device, ops, cpu_linears)

    @classmethod
    def from_tensors(
        cls,
        spec: ModelSpec,
        tensors: dict[str, Weight],
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps = reference,
        cpu_linears: bool = False,
    ) -> DecoderModel:
        """`tensors`: tensors, or a GGUF file's quantized blocks (models/linear.py)."""
        formats = sorted({w.qtype for w in tensors.values() if isinstance(w, QuantizedWeight)})

        def take(name: str) -> Weight:
            return place(tensors.pop(name), device, dtype)

        def norm(name: str) -> torch.Tensor:
            # Norm weights stay fp32: they multiply fp32 activations in rms_norm.
            return (dense(tensors.pop(name), torch.float32) + spec.norm_offset).to(device)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            qkv = [take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight")]
            gate, up = take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")
            sandwich = spec.sandwich_norm
            layers.append(
                LayerWeights(
                    qkv=make_linear(qkv, cpu_kernel=cpu_linears),
                    o=make_linear([take(attn + "o_proj.weight")], cpu_kernel=cpu_linears),
                    gate_up=gated_linear(gate, up, spec.activation, cpu_kernel=cpu_linears),
                    down=make_linear([take(mlp + "down_proj.weight")], cpu_kernel=cpu_linears),
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
        embed_weight = take("model.embed_tokens.weight")
        embed = dense(embed_weight, dtype)
        # A tied head over quantized blocks multiplies the blocks, not the dequantized table.
        tied = spec.tie_word_embeddings or "lm_head.weight" not in tensors
        lm_head = embed_weight if tied else take("lm_head.weight")
        lm_head_linear = make_linear([lm_head], cpu_kernel=cpu_linears)
        model = cls(spec, embed, layers, norm("model.norm.weight"), lm_head_linear, ops)
        if formats:
            model.weight_format = "gguf " + "+".join(formats)
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        spec = self.spec
        delta = F.embedding(input_ids, self.embed)
        if spec.embed_scale != 1.0:
            delta = delta * torch.tensor(spec.embed_scale, dtype=self.dtype)
        rope = [rope_cos_sin(positions, inv_freq, self.dtype) for inv_freq in self.inv_freqs]
        residual: torch.Tensor | None = None  # the first layer's stream is the embedding itself
        for i, layer in enumerate(self.layers):
            cos, sin = rope[spec.layer_rope[i]]
            delta, residual = self._layer(i, layer, delta, residual, cos, sin, attention)
        hidden, _ = self.ops.add_rms_norm(delta, residual, self.final_norm, spec.rms_norm_eps)
        return hidden

    def _layer(
        self,
        i: int,
        w: LayerWeights,
        delta: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: Attention,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the stream before it): the next layer adds them."""
        spec, eps = self.spec, self.spec.rms_norm_eps
        num_tokens = delta.shape[0]
        x, residual = self.ops.add_rms_norm(delta, residual, w.attn_norm, eps)
        q, k, v = torch.split(w.qkv(x), [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, spec.num_q_heads, spec.head_dim)
        k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        if w.q_norm is not None and w.k_norm is not None:  # spec.qk_norm
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        attn = attention(i, q, k, v, cos, sin, spec.layer_windows[i]).reshape(num_tokens, self.q_size)
        attn = w.o(attn)
        if w.post_attn_norm is not None:
            attn = rms_norm(attn, w.post_attn_norm, eps)
        x, residual = self.ops.add_rms_norm(attn, residual, w.mlp_norm, eps)
        mlp = w.down(w.gate_up(x))
        if w.post_mlp_norm is not None:
            mlp = rms_norm(mlp, w.post_mlp_norm, eps)
        return mlp, residual

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
