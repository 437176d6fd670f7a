"""A GGUF file as a checkpoint: its tensors under the Hugging Face names the decoder
reads, the linear layers' weights left in their quantized blocks.

What is served: the llama architecture (llama.cpp's name for Llama, SmolLM, Mistral
without sliding windows), qwen2 (Qwen2 / Qwen2.5: q, k, v biases), qwen3 (q and k
norms), gemma2 and gemma3 text (sandwich norms, stored by llama.cpp as 1 + w: put
back as w, as transformers' reader does) and phi3 (q, k, v fused in attn_qkv, gate and
up in ffn_up: split by rows into Llama's parts; its sliding window, which transformers'
config leaves out, from the file: gguf_config.py); block formats kernels/gguf_quant.py
decodes; F32, F16 and BF16 tensors (read as fp32). Anything else is refused by name
at load, and so is metadata that disagrees with the config transformers reads from
the file (`_check`: it reads no key_length for qwen3, no soft-caps, query scale or
rope scaling for Gemma). The embedding table and the norms are dequantized at load
(`linear.dense`): a lookup reads a few rows, and norms are fp32 in every GGUF; a
tied LM head keeps the embedding's blocks.

For llama, llama.cpp's converter permutes the rows of q and k (its RoPE pairs
neighbouring features, Hugging Face's the two halves of a head); the rows are put
back here as transformers' GGUF loader does. The others keep Hugging Face's order
(llama.cpp runs their RoPE in the NeoX style). A row of blocks is one output
feature, so the permutation moves byte rows and never touches a block.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from worker_svc.models.gguf_config import metadata_number
from worker_svc.models.linear import Weight
from worker_svc.models.spec import ModelSpec


@dataclass(frozen=True)
class _Arch:
    """How llama.cpp wrote an architecture's tensors, where it differs from llama's."""

    permuted_qk: bool = False  # q and k rows permuted for llama.cpp's RoPE pairing
    layer_names: Mapping[str, str] = field(default_factory=dict)  # over _LAYER's
    norm_offset: float = 0.0  # norms stored as norm_offset + w
    fused: bool = False  # q, k, v in one attn_qkv; gate and up in one ffn_up (phi3)


_GEMMA_LAYER = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
ARCHITECTURES = {
    "llama": _Arch(permuted_qk=True),
    "qwen2": _Arch(),
    "qwen3": _Arch(),
    "gemma2": _Arch(layer_names=_GEMMA_LAYER, norm_offset=1.0),
    "gemma3": _Arch(layer_names=_GEMMA_LAYER, norm_offset=1.0),  # text only (gemma-3-1b, 270m)
    "phi3": _Arch(fused=True),
}
SERVED_ARCHITECTURES = tuple(ARCHITECTURES)
_DENSE_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Tensors that restate what the metadata says (llama 3's RoPE frequencies, which the
# spec computes from the rope scaling parameters, as transformers does).
_REDUNDANT = ("rope_freqs.weight",)


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def architecture(reader: GGUFReader) -> str:
    name = reader.fields["general.architecture"]
    return bytes(name.parts[name.data[0]]).decode()


def hf_name(name: str, arch: str = "llama") -> str:
    """The Hugging Face name of a GGUF tensor; a name no decoder reads is refused (a bias
    or a norm the architecture does not have is refused by the model's loader: it reads
    every tensor it is given or names the one it did not)."""
    if name in _TOP:
        return _TOP[name]
    layer = {**_LAYER, **ARCHITECTURES[arch].layer_names}
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} is not served (a decoder's tensors are: {', '.join(_TOP)}, blk.N.*)")


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation for `heads` heads."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _check(reader: GGUFReader, arch: str, spec: ModelSpec) -> None:
    """The file's metadata against the config transformers read from it, which leaves out
    some keys (qwen3's key_length: 128 assumed; gemma2's soft-caps and query scale: its
    defaults; phi3's rotary dimensions: all of a head): a head split wrongly would read
    every weight with the wrong shape, a cap, a scale or a rotation the file does not mean
    would serve another model."""
    checks = (
        (f"{arch}.attention.key_length", "head_dim", spec.head_dim),
        (f"{arch}.attn_logit_softcapping", "attn_logit_softcapping", spec.attn_softcap),
        (f"{arch}.final_logit_softcapping", "final_logit_softcapping", spec.final_softcap),
        (f"{arch}.rope.dimension_count", "rotary dimensions", spec.rotary_dim or spec.head_dim),
    )
    for key, config, value in checks:
        got = metadata_number(reader, key)
        if got is not None and abs(got - value) > 1e-3 * max(1.0, abs(value)):
            raise ValueError(f"GGUF {key} is {got:g}, the config's {config} {value:g}: not served")
    if not arch.startswith("gemma"):
        return
    scalar = spec.attention_scale**-2
    if abs(scalar - spec.head_dim) > 1e-3 * spec.head_dim:
        # the file holds no query scale: llama.cpp takes head_dim (and n_embd / n_head for 27B)
        raise ValueError(
            f"GGUF {arch} holds no query_pre_attn_scalar; the config's {scalar:g} is not the head_dim "
            f"{spec.head_dim} llama.cpp scales by: not served"
        )
    factor = metadata_number(reader, f"{arch}.rope.scaling.factor")  # Gemma 3 4B+: transformers reads none
    if factor is not None and factor != 1.0:
        raise ValueError(f"GGUF {arch}.rope.scaling.factor is {factor:g}, the config has no rope scaling: not served")


def _rows(weight: torch.Tensor | QuantizedWeight, index: torch.Tensor) -> torch.Tensor | QuantizedWeight:
    """Output rows `index` of a weight: byte rows of blocks, or a tensor's rows."""
    return weight.rows(index) if isinstance(weight, QuantizedWeight) else weight[index].contiguous()


def _unfused(name: str, weight: torch.Tensor | QuantizedWeight, spec: ModelSpec) -> dict[str, Weight] | None:
    """phi3's fused tensors as Llama's parts, by rows (a row of blocks is one output):
    attn_qkv as q, k, v; ffn_up as gate, then up (transformers' order too). None for any
    other tensor."""
    parts = name.split(".")
    if len(parts) != 4 or parts[2] not in ("attn_qkv", "ffn_up"):
        return None
    q, kv = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    names: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    sizes: tuple[int, ...] = (q, kv, kv)
    if parts[2] == "ffn_up":
        names, sizes = ("mlp.gate_proj", "mlp.up_proj"), (spec.intermediate_size,) * 2
    rows = weight.out_features if isinstance(weight, QuantizedWeight) else int(weight.shape[0])
    if rows != sum(sizes):
        raise ValueError(f"GGUF tensor {name!r} has {rows} rows, not the {' + '.join(map(str, sizes))} it fuses")
    out: dict[str, Weight] = {}
    for part, start, size in zip(names, itertools.accumulate(sizes, initial=0), sizes, strict=False):
        out[f"model.layers.{parts[1]}.{part}.{parts[3]}"] = _rows(weight, torch.arange(start, start + size))
    return out


def read_gguf(path: str | Path, spec: ModelSpec) -> dict[str, Weight]:
    """Every tensor of the file by its Hugging Face name: QuantizedWeight for block
    formats (the file's bytes, copied into memory), fp32 tensors otherwise."""
    reader = GGUFReader(path)
    arch = architecture(reader)
    if arch not in SERVED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served (served: {', '.join(SERVED_ARCHITECTURES)})")
    _check(reader, arch, spec)
    layout = ARCHITECTURES[arch]
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        if tensor.name in _REDUNDANT:
            continue
        qtype = tensor.tensor_type
        shape = [int(n) for n in reversed(tensor.shape.tolist())]  # GGUF lists the innermost first
        weight: Weight
        if qtype in _DENSE_TYPES:
            weight = torch.from_numpy(np.array(dequantize(tensor.data, qtype), dtype=np.float32).reshape(shape))
        elif qtype.name in BLOCK_FORMATS and len(shape) == 2:
            data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1))
            weight = QuantizedWeight(qtype.name, shape[0], shape[1], data)
        else:
            served = ", ".join(["F32", "F16", "BF16", *BLOCK_FORMATS])
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {qtype.name}, not served (served: {served})")
        if layout.fused and (parts := _unfused(tensor.name, weight, spec)) is not None:
            weights.update(parts)
            continue
        name = hf_name(tensor.name, arch)
        heads = spec.num_q_heads if ".attn_q." in tensor.name else spec.num_kv_heads
        if layout.permuted_qk and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            weight = _rows(weight, unpermute_rows(shape[0], heads))
        if layout.norm_offset and tensor.name.endswith("norm.weight") and isinstance(weight, torch.Tensor):
            weight = weight - layout.norm_offset
        weights[name] = weight
    return weights
