"""A GGUF file as a checkpoint: its tensors under the Hugging Face names the decoder
reads, the linear layers' weights left in their quantized blocks.

What is served: the llama architecture (llama.cpp's name for Llama, SmolLM, Mistral
without sliding windows), qwen2 (Qwen2 / Qwen2.5: q, k, v biases) and qwen3 (q and k
norms); block formats kernels/gguf_quant.py decodes; F32, F16 and BF16 tensors (read
as fp32). Anything else is refused by name at load. The
embedding table and the norms are dequantized at load (`linear.dense`): a lookup
reads a few rows, and norms are fp32 in every GGUF; a tied LM head keeps the
embedding's blocks.

For llama, llama.cpp's converter permutes the rows of q and k (its RoPE pairs
neighbouring features, Hugging Face's the two halves of a head); the rows are put back
here as transformers' GGUF loader does. qwen2 and qwen3 keep Hugging Face's order
(llama.cpp runs their RoPE in the NeoX style). A row of blocks is one output feature, so the
permutation moves byte rows and never touches a block.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from worker_svc.models.linear import Weight
from worker_svc.models.spec import ModelSpec

# Each served architecture, and whether llama.cpp permuted its q and k rows.
PERMUTED_QK = {"llama": True, "qwen2": False, "qwen3": False}
SERVED_ARCHITECTURES = tuple(PERMUTED_QK)
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
    field = reader.fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def hf_name(name: str) -> str:
    """The Hugging Face name of a GGUF tensor; a name no decoder reads is refused (a bias
    or a norm the architecture does not have is refused by the model's loader: it reads
    every tensor it is given or names the one it did not)."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER and parts[3] in ("weight", "bias"):
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} is not served (a decoder's tensors are: {', '.join(_TOP)}, blk.N.*)")


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation for `heads` heads."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def _check_head_dim(reader: GGUFReader, arch: str, spec: ModelSpec) -> None:
    """The file's head width against the config's: transformers' GGUF config reads no
    key_length for some architectures (qwen3: 128 assumed), and a head split wrongly would
    read every weight with the wrong shape."""
    field = reader.fields.get(f"{arch}.attention.key_length")
    width = None if field is None else int(field.parts[field.data[0]][0])
    if width is not None and width != spec.head_dim:
        config = f"the config's head_dim {spec.head_dim}"
        raise ValueError(f"GGUF {arch}.attention.key_length is {width}, {config}: not served")


def read_gguf(path: str | Path, spec: ModelSpec) -> dict[str, Weight]:
    """Every tensor of the file by its Hugging Face name: QuantizedWeight for block
    formats (the file's bytes, copied into memory), fp32 tensors otherwise."""
    reader = GGUFReader(path)
    arch = architecture(reader)
    if arch not in SERVED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served (served: {', '.join(SERVED_ARCHITECTURES)})")
    _check_head_dim(reader, arch, spec)
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        if tensor.name in _REDUNDANT:
            continue
        name = hf_name(tensor.name)
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
        heads = spec.num_q_heads if ".attn_q." in tensor.name else spec.num_kv_heads
        if PERMUTED_QK[arch] and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            order = unpermute_rows(shape[0], heads)
            weight = weight.rows(order) if isinstance(weight, QuantizedWeight) else weight[order].contiguous()
        weights[name] = weight
    return weights
