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

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast, runtime_checkable

import torch

from kernels import reference
from kernels.decoder_loop import LoopStep
from kernels.gguf_quant import QuantizedWeight
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.gguf import is_gguf, read_gguf
from worker_svc.models.layer_loop import build_layer_loop
from worker_svc.models.layer_weights import LayerWeights
from worker_svc.models.layers import rms_norm
from worker_svc.models.linear import Gated, Projection, Weight, dense, embed_rows, place
from worker_svc.models.moe import SparseMoe, load_sparse_moe
from worker_svc.models.projections import gated_projection, projection, tied_head
from worker_svc.models.rope import rope_cos_sin
from worker_svc.models.spec import ModelSpec, load_spec, quant_scheme, read_config
from worker_svc.models.weights import CheckpointTensors, Tensors, Weights, check_consumed, to_canonical
from worker_svc.models.wquant_load import QuantizedTensors, refuse_quantized


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


@runtime_checkable
class LoopAttention(Protocol):
    """An Attention that can hand a step to the C++ layer loop (kernels/decoder_loop.py):
    its step's tensors, or None where this step must run the Python loop."""

    def loop_step(self) -> LoopStep | None: ...


# The projection hook (LoRA, worker_svc/lora/slots.py): (layer, group, projection) ->
# the projection the layer calls instead, for the groups qkv, o, gate_up (before the
# activation) and down.
ProjectionHook = Callable[[int, str, Projection], Projection]


class AddRmsNorm(Protocol):
    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, /
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerOps(Protocol):
    """The fused element-wise ops the decoder runs beside attention: kernels/reference.py
    (the oracle), kernels/triton/, kernels/cpu_ops.py (an attention backend's ops)."""

    @property
    def add_rms_norm(self) -> AddRmsNorm: ...


# Where each family's layer norms sit (spec.norms), by checkpoint name: before
# attention, before the MLP, after attention, after the MLP. Llama's
# "post_attention_layernorm" is the pre-MLP norm; Gemma's and OLMo 2's normalize
# the attention output.
NORM_NAMES: dict[str, tuple[str | None, str | None, str | None, str | None]] = {
    "pre": ("input_layernorm", "post_attention_layernorm", None, None),
    "sandwich": (
        "input_layernorm",
        "pre_feedforward_layernorm",
        "post_attention_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": (None, None, "post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderModel:
    def __init__(
        self,
        spec: ModelSpec,
        embed: Weight,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: Projection,
        ops: LayerOps,
        dtype: torch.dtype,
    ):
        """embed: the table, or a GGUF file's blocks (then `dtype` says the activations'
        dtype): a step dequantizes only the rows of its tokens, so the table stays at the
        file's size (a tied LM head multiplies the same blocks)."""
        self.spec = spec
        self.ops = ops
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        self.dtype = dtype
        # What the linear weights are stored as (the `worker compute` line): the dtype,
        # or a GGUF file's block formats (set by from_tensors).
        self.weight_format = str(self.dtype).removeprefix("torch.")
        self.device = final_norm.device
        self.ropes = [
            (table, torch.tensor(table.inv_freq, dtype=torch.float32, device=self.device)) for table in spec.ropes
        ]
        self.q_size = spec.num_q_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.heads = [spec.num_q_heads, spec.num_kv_heads, spec.num_kv_heads]  # of the fused q, k, v projection
        # Whether a step's layers run in one C++ call, decided here once (models/layer_loop.py);
        # `layer_loop_label` says which loop runs, or why not the C++ one.
        self.layer_loop, self.layer_loop_label = build_layer_loop(spec, layers, ops, dtype, self.device)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        transform: Callable[[ModelSpec, Tensors], tuple[ModelSpec, Tensors]] | None = None,
        ops: LayerOps = reference,
        cpu_linears: bool = False,
        hook: ProjectionHook | None = None,
        quant_activations: str = "none",
    ) -> DecoderModel:
        """`transform`: applied to the checkpoint before it reaches the device (a
        tensor-parallel rank keeps its slice, worker_svc/parallel/sharding.py).
        `ops`: the fused element-wise ops (an attention backend's). `cpu_linears`: pack
        the weights for the C++ linear kernels on the CPU (models/linear.py). `hook`:
        wraps the decoder's projections (ProjectionHook). `quant_activations`: int8 =
        a GGUF model's linears quantize x per 32-block (--quant-activations)."""
        spec = load_spec(model_dir)
        if is_gguf(model_dir):
            if transform is not None:
                raise UnsupportedModel("a GGUF model is not split over ranks (tensor parallel): serve it on one worker")
            weights = read_gguf(model_dir, spec)
            if "lm_head.weight" not in weights:  # llama.cpp's files leave a tied head out
                spec = dataclasses.replace(spec, tie_word_embeddings=True)
            return cls.from_tensors(spec, weights, dtype, device, ops, cpu_linears, hook, quant_activations)
        tensors: Tensors = CheckpointTensors.open(Path(model_dir))
        scheme = quant_scheme(read_config(model_dir))
        if scheme is not None:
            refuse_quantized(spec, transform is not None)
            model = cls.from_tensors(
                spec, QuantizedTensors(tensors, scheme), dtype, device, ops, cpu_linears, hook, quant_activations
            )
            model.weight_format = scheme.describe()
            return model
        to_canonical(spec, tensors)
        if transform is not None:
            spec, tensors = transform(spec, tensors)
        return cls.from_tensors(spec, cast(Weights, tensors), dtype, device, ops, cpu_linears, hook, quant_activations)

    @classmethod
    def from_tensors(
        cls,
        spec: ModelSpec,
        tensors: Weights,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps = reference,
        cpu_linears: bool = False,
        hook: ProjectionHook | None = None,
        quant_activations: str = "none",
    ) -> DecoderModel:
        """The model over `tensors` (Llama's names, to_canonical; tensors, or a GGUF
        file's quantized blocks: models/linear.py), each taken once: one left over is
        an error naming it."""
        # Only a GGUF file's weights (a dict) hold blocks; reading the values of a lazy
        # checkpoint here would read it twice.
        blocks = tensors.values() if isinstance(tensors, dict) else ()
        formats = sorted({w.qtype for w in blocks if isinstance(w, QuantizedWeight)})
        if quant_activations != "none" and not formats:
            raise UnsupportedModel(f"--quant-activations {quant_activations}: the model has no GGUF block weights")
        qa = quant_activations

        def take(name: str) -> Weight:
            return place(tensors.pop(name), device, dtype)

        def take_dense(name: str) -> torch.Tensor:  # biases, experts: tensors even in a GGUF file
            return dense(take(name), dtype)

        def bias(names: list[str], present: bool) -> torch.Tensor | None:
            return torch.cat([take_dense(n) for n in names]) if present else None

        def norm(name: str | None) -> torch.Tensor | None:
            # Norm weights stay fp32: they multiply fp32 activations in rms_norm.
            return None if name is None else (dense(tensors.pop(name), torch.float32) + spec.norm_offset).to(device)

        def linear(layer: int, group: str, prefix: str, names: list[str], biased: bool) -> Projection:
            weights = [take(prefix + n + ".weight") for n in names]
            proj = projection(weights, bias([prefix + n + ".bias" for n in names], biased), cpu_linears, qa)
            return proj if hook is None else hook(layer, group, proj)

        layers = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            moe: SparseMoe | None = None
            gate_up: Projection | None = None
            if spec.moe is not None and spec.moe.sparse_layers[i]:
                moe = load_sparse_moe(spec.moe, mlp, take_dense, spec.activation, cpu_linears)
            else:
                gate, up = take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")
                gate_up_bias = bias([mlp + "gate_proj.bias", mlp + "up_proj.bias"], spec.mlp_bias)
                if hook is None:
                    gate_up = gated_projection(gate, up, gate_up_bias, spec.activation, cpu_linears, qa)
                else:  # the hook's sum comes before the activation: no fused gated kernel
                    fused = projection([gate, up], gate_up_bias, cpu_linears, qa)
                    gate_up = Gated(hook(i, "gate_up", fused), spec.activation, cpu_linears)
            pre_attn, pre_mlp, post_attn, post_mlp = NORM_NAMES[spec.norms]
            layers.append(
                LayerWeights(
                    qkv=linear(i, "qkv", attn, ["q_proj", "k_proj", "v_proj"], spec.qkv_bias),
                    o=linear(i, "o", attn, ["o_proj"], spec.o_bias),
                    gate_up=gate_up,
                    down=None if moe else linear(i, "down", mlp, ["down_proj"], spec.mlp_bias),
                    attn_norm=norm(pre_attn and p + pre_attn + ".weight"),
                    mlp_norm=norm(pre_mlp and p + pre_mlp + ".weight"),
                    post_attn_norm=norm(post_attn and p + post_attn + ".weight"),
                    post_mlp_norm=norm(post_mlp and p + post_mlp + ".weight"),
                    q_norm=norm(attn + "q_norm.weight" if spec.qk_norm else None),
                    k_norm=norm(attn + "k_norm.weight" if spec.qk_norm else None),
                    moe=moe,
                )
            )
        embed_weight = take("model.embed_tokens.weight")
        # A tied head over quantized blocks multiplies the blocks, not the dequantized table.
        lm_head = tied_head(embed_weight, tensors, take) if spec.tie_word_embeddings else take("lm_head.weight")
        final_norm = norm("model.norm.weight")
        assert final_norm is not None
        check_consumed(tensors, spec.model_type)
        head = projection([lm_head], None, cpu_linears, qa, shared=spec.tie_word_embeddings)
        model = cls(spec, embed_weight, layers, final_norm, head, ops, dtype)
        if formats:
            model.weight_format = "gguf " + "+".join(formats)
        return model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        spec = self.spec
        delta = embed_rows(self.embed, input_ids, self.dtype)
        if spec.embed_scale != 1.0:
            delta = delta * torch.tensor(spec.embed_scale, dtype=self.dtype)
        rope = [rope_cos_sin(positions, table, inv, self.dtype) for table, inv in self.ropes]
        residual: torch.Tensor | None = None  # the first layer's stream is the embedding itself
        loop = self.layer_loop
        step = attention.loop_step() if loop is not None and isinstance(attention, LoopAttention) else None
        if loop is not None and step is not None:  # _layer's ops, in one call: bit-identical
            cos, sin = rope[0]
            delta, residual = loop(delta, cos, sin, step)
        else:
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
        x, residual = self._add_norm(delta, residual, w.attn_norm)
        qkv = w.qkv(x)
        if spec.qk_norm == "full" and w.q_norm is not None and w.k_norm is not None:
            q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
            q = q.view(num_tokens, spec.num_q_heads, spec.head_dim)
            k = k.view(num_tokens, spec.num_kv_heads, spec.head_dim)
            v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        else:  # the heads as views of the projection: two ops a layer, not four
            q, k, v = qkv.view(num_tokens, sum(self.heads), spec.head_dim).split_with_sizes(self.heads, dim=1)
        if spec.qk_norm == "head" and w.q_norm is not None and w.k_norm is not None:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        attn = attention(i, q, k, v, cos, sin, spec.layer_windows[i]).reshape(num_tokens, self.q_size)
        attn = self._block_output(w.o(attn), w.post_attn_norm)
        x, residual = self._add_norm(attn, residual, w.mlp_norm)
        mlp = self._block_output(self._mlp(w, x), w.post_mlp_norm)
        return mlp, residual

    @staticmethod
    def _mlp(w: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        if w.moe is not None:
            return w.moe(x)
        assert w.gate_up is not None and w.down is not None
        return w.down(w.gate_up(x))

    def _add_norm(
        self, delta: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's input, the stream): the norm of residual + delta, or the sum
        itself where the family has no norm before the block (OLMo 2)."""
        if weight is not None:
            return self.ops.add_rms_norm(delta, residual, weight, self.spec.rms_norm_eps)
        stream = delta if residual is None else residual + delta
        return stream, stream

    def _block_output(self, out: torch.Tensor, post_norm: torch.Tensor | None) -> torch.Tensor:
        if post_norm is not None:
            out = rms_norm(out, post_norm, self.spec.rms_norm_eps)
        if self.spec.residual_scale != 1.0:
            out = out * self.spec.residual_scale
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] for the selected hidden rows."""
        logits = self.lm_head(hidden).float()
        if self.spec.logits_divisor != 1.0:
            logits = logits / self.spec.logits_divisor
        if self.spec.final_softcap:
            logits = torch.tanh(logits / self.spec.final_softcap) * self.spec.final_softcap
        return logits
