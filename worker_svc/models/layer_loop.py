"""Which models run a step's layers in one C++ call (kernels/decoder_loop.py), decided
once at load: the plain pre-norm layer (Llama, SmolLM2, Qwen2, Mistral...) whose
every projection is a C++ kernel's (packed fp32/bf16 weights, or GGUF blocks the C++
kernel decodes), on the CPU with the C++ element-wise ops. Anything else in a layer
(LoRA's hook, mixture-of-experts, q/k norms, post norms, a residual scale, several
RoPE tables, the reference or oneDNN multiplies) keeps the Python loop, and the
reason is what the worker's compute line says."""

from __future__ import annotations

import dataclasses

import torch

from kernels import cpu_ops, decoder_loop
from kernels.decoder_loop import LayerLoop, LoopLayer, LoopPart, LoopProjection
from worker_svc.models.layer_weights import LayerWeights
from worker_svc.models.linear import Concat, Gated, GatedLinear, Linear, Projection, QuantLinear
from worker_svc.models.projections import Biased
from worker_svc.models.spec import ModelSpec

# The layer_loop label of the worker's compute line when the loop runs.
TAKEN = "C++ (one call per step)"


class NotTaken(Exception):
    """Why a model keeps the Python loop."""


def build_layer_loop(
    spec: ModelSpec, layers: list[LayerWeights], ops: object, dtype: torch.dtype, device: torch.device
) -> tuple[LayerLoop | None, str]:
    """(the loop, TAKEN), or (None, "python: why not")."""
    try:
        _check_model(spec, ops, dtype, device)
        loop_layers = [_loop_layer(spec, i, layer) for i, layer in enumerate(layers)]
    except NotTaken as why:
        return None, f"python: {why}"
    return LayerLoop(loop_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps), TAKEN


def _check_model(spec: ModelSpec, ops: object, dtype: torch.dtype, device: torch.device) -> None:
    if device.type != "cpu" or ops is not cpu_ops or not cpu_ops.available():
        raise NotTaken("not the CPU's C++ ops")
    if not decoder_loop.enabled():
        raise NotTaken("PAGEDSERVE_LAYER_LOOP=0")
    if dtype not in cpu_ops.LINEAR_DTYPES:
        raise NotTaken(f"dtype {dtype}")
    unplain = {
        "norms": spec.norms != "pre",
        "qk_norm": bool(spec.qk_norm),
        "moe": spec.moe is not None,
        "residual_scale": spec.residual_scale != 1.0,
        "several rope tables": len(spec.ropes) != 1 or any(r != 0 for r in spec.layer_rope),
    }
    if any(unplain.values()):
        raise NotTaken(", ".join(name for name, on in unplain.items() if on))


def _loop_layer(spec: ModelSpec, i: int, w: LayerWeights) -> LoopLayer:
    extras = {"post norms": w.post_attn_norm is not None or w.post_mlp_norm is not None, "moe": w.moe is not None}
    if any(extras.values()):
        raise NotTaken(f"layer {i} has " + ", ".join(name for name, on in extras.items() if on))
    if w.attn_norm is None or w.mlp_norm is None or w.gate_up is None or w.down is None:
        raise NotTaken(f"layer {i} is not a pre-norm gated MLP layer")
    return LoopLayer(
        attn_norm=cpu_ops.fp32(w.attn_norm),  # as add_rms_norm hands a norm weight over
        mlp_norm=cpu_ops.fp32(w.mlp_norm),
        window=spec.layer_windows[i],
        qkv=_projection(w.qkv),
        o=_projection(w.o),
        gate_up=_projection(w.gate_up),
        down=_projection(w.down),
    )


def _projection(p: Projection) -> LoopProjection:
    """What `p` calls, as the loop calls it; NotTaken where a part is not a C++ kernel's."""
    if isinstance(p, Biased):
        inner = _projection(p.linear)
        if inner.bias is not None or inner.gated or any(part.activation for part in inner.parts):
            raise NotTaken("a bias after an activation")
        return dataclasses.replace(inner, bias=p.bias)
    if isinstance(p, Gated):
        if not p.cpu_kernel:
            raise NotTaken("a gated activation in torch")
        inner = _projection(p.linear)
        if inner.gated or any(part.activation for part in inner.parts):
            raise NotTaken("two activations")
        return dataclasses.replace(inner, gated=p.activation)
    if isinstance(p, Concat):
        return LoopProjection(tuple(_part(part) for part in p.parts))
    return LoopProjection((_part(p),))


def _part(p: Projection) -> LoopPart:
    if isinstance(p, Linear) and p.kernel == "cpu":
        return LoopPart("linear", p.weight, p.out_features, p.in_features)
    if isinstance(p, GatedLinear) and p.weight is not None:
        return LoopPart("linear", p.weight, p.out_features, p.in_features, activation=p.activation)
    if isinstance(p, QuantLinear) and p.kernel == "cpu":
        op = "quant_linear_int8" if p.int8 else "quant_linear"
        return LoopPart(op, p.weight.data, p.out_features, p.in_features, qtype=p.weight.qtype)
    raise NotTaken(f"a {type(p).__name__} projection")
