"""A linear layer's weight, in the layout this device multiplies fastest.

On CPU, with the C++ kernels built and the fused forward on (not --enforce-eager):
fp32 and bf16 weights are packed once, at load, into the layout
kernels/csrc/linear_cpu.cpp streams (kernels.cpu_ops.pack_linear), one copy, used
for every batch size. A decode step's time is its weights' read, and that layout
reads them as one sequential stream: one token's 269 MB of bf16 weights in 13.9 ms
on one thread against 21.3 ms through oneDNN's packed weights, fp32 24.4 against
35.9 ms through MKL's; at a prefill's thousands of rows it keeps oneDNN's pace
(bench/results/peers.md). The gate-up projection of a gated MLP multiplies into
its activation (GatedLinear), so the [T, 2 x intermediate] product is never written.

Otherwise (--enforce-eager, the per-op path, or no kernels): bf16 weights are
reordered once into oneDNN's blocked format (F.linear would reorder the plain
[out, in] matrix on every call, which at decode batch sizes costs about as much as
the multiply); fp32 weights stay plain, as transformers multiplies them; CUDA
weights stay plain too (cuBLAS needs no reorder).

A GGUF model's weights stay in their quantized blocks (kernels/gguf_quant.py): a
QuantLinear multiplies them on CUDA with kernels/triton/gguf_gemm.py and on the CPU
with kernels/csrc/quant_linear_cpu.cpp (both decode the blocks inside their loops,
no dequantized copy), the C++ one where it takes the format, and otherwise with the
reference (dequantize, then multiply: slower, same values). `make_linear` and `gated_linear`
build whichever a weight needs, so the decoder has one path for both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kernels import cpu_ops, quant_cpu_ops, reference, wquant, wquant_cpu
from kernels.gguf_quant import QuantizedWeight, quant_linear, quant_linear_int8, stack
from kernels.wquant import WQuantWeight
from kernels.wquant_formats import in_group_order

# A checkpoint's weight: a tensor, a GGUF file's quantized blocks, or a quantized
# safetensors checkpoint's FP8/INT8/INT4 weight (kernels/wquant.py).
Weight = torch.Tensor | QuantizedWeight | WQuantWeight

# The oneDNN reorder is tuned for a batch size; decode batches are tens of rows.
_PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can reorder this weight here. Its bf16 reorder needs AVX-512 BW/VL/DQ
    or AVX-NE-CONVERT and raises on an AVX2-only CPU, so bf16 weights stay plain there
    (F.linear: torch's own bf16 path, slow but exact)."""
    mkldnn = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and mkldnn
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def cpu_kernel_takes(weight: torch.Tensor) -> bool:
    """Whether kernels/csrc/linear_cpu.cpp can multiply this weight here."""
    return weight.device.type == "cpu" and weight.dtype in cpu_ops.LINEAR_DTYPES and cpu_ops.available()


class Projection(Protocol):
    """What the decoder calls a projection: x [T, in] -> [T, out]. A Linear, or a
    tensor-parallel wrapper of one (parallel/layers.py)."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


class Linear:
    """y = x @ weight.T for x [T, in]; weight [out, in]. cpu_kernel: packed for the C++
    kernel where it takes the weight (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, pack: bool = True, cpu_kernel: bool = False):
        self.out_features, self.in_features = weight.shape
        self.kernel = ""  # plain: F.linear
        if cpu_kernel and cpu_kernel_takes(weight):
            self.kernel = "cpu"
        elif pack and can_pack(weight):
            self.kernel = "onednn"
        # Only one copy is kept: a packed one replaces the plain weight.
        if self.kernel == "cpu":
            self.weight = cpu_ops.pack_linear(weight)
        elif self.kernel == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        else:
            self.weight = weight

    @property
    def packed(self) -> bool:
        return self.kernel != ""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu":
            return cpu_ops.linear(x, self.weight, self.out_features, self.in_features)
        if self.kernel == "onednn":
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
            return out
        return F.linear(x, self.weight)


class Gated:
    """act(gate) * up over a projection whose output is [gate, up]: with cpu_kernel, the
    C++ gated_act (the one the C++ layer loop calls), else the torch reference."""

    def __init__(self, linear: Projection, activation: str, cpu_kernel: bool = False):
        self.linear, self.activation, self.cpu_kernel = linear, activation, cpu_kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return cpu_ops.gated_act(y, self.activation) if self.cpu_kernel else reference.gated_act(y, self.activation)


class GatedLinear:
    """act(x @ gate.T) * (x @ up.T) for weight = [gate; up] [2 x intermediate, in]: the
    fused gate-up projection of a gated MLP and its activation. The C++ kernel
    computes both halves' rows of an output column together; elsewhere a Linear over
    the stacked weight, then the activation in torch."""

    def __init__(self, weight: torch.Tensor, activation: str, cpu_kernel: bool = False):
        self.activation = activation
        self.out_features, self.in_features = weight.shape[0] // 2, weight.shape[1]
        self.fused = cpu_kernel and cpu_kernel_takes(weight)
        self.weight = cpu_ops.pack_linear(weight, gated=True) if self.fused else None
        self.gated = None if self.fused else Gated(Linear(weight), activation, cpu_kernel)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated is None:
            assert self.weight is not None
            return cpu_ops.linear(x, self.weight, self.out_features, self.in_features, self.activation)
        return self.gated(x)


QuantOp = Callable[[torch.Tensor, QuantizedWeight], torch.Tensor]


def quant_kernel(device: torch.device, cpu_kernel_takes: bool) -> str:
    """Which multiply GGUF blocks on `device` get: triton on CUDA (as the attention
    backend's auto picks it there), cpu where the C++ kernel takes the weight, else
    "" (the reference)."""
    if device.type == "cuda":
        return "triton"
    return "cpu" if cpu_kernel_takes else ""


def quant_op(kernel: str) -> QuantOp:
    if kernel == "triton":
        from kernels.triton import gguf_gemm  # imported lazily: triton is heavy and optional on CPU

        return gguf_gemm.quant_linear
    return quant_cpu_ops.quant_linear if kernel == "cpu" else quant_linear


class QuantLinear:
    """y = x @ W.T for W in GGUF blocks: decoded inside the kernel's loop on CUDA
    (kernels/triton/gguf_gemm.py) and on the CPU where the C++ kernel takes the
    format, else the reference (dequantize on every call, then multiply).
    activations "int8": x quantized per 32-block and integer dot products
    (--quant-activations; the C++ kernel, else its reference), the C++ kernel's weight
    packed for it at load (quant_cpu_ops.pack_int8) unless `shared` (a tied head's blocks
    are the embedding table's too, which reads rows in the file's layout)."""

    def __init__(
        self, weight: QuantizedWeight, cpu_kernel: bool = False, activations: str = "none", shared: bool = False
    ):
        self.weight: QuantizedWeight | quant_cpu_ops.Int8Panels = weight
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.kernel = quant_kernel(weight.data.device, cpu_kernel and quant_cpu_ops.takes(weight))
        self.op: Callable[[torch.Tensor, Any], torch.Tensor] = quant_op(self.kernel)
        self.int8 = activations == "int8"
        if self.int8:
            self.op = quant_cpu_ops.quant_linear_int8 if self.kernel == "cpu" else quant_linear_int8
            if self.kernel == "cpu" and not shared:
                self.weight = quant_cpu_ops.pack_int8(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight)


class WQuantLinear:
    """y = x @ W.T for an FP8/INT8/INT4 safetensors weight: the Triton kernel on
    CUDA (kernels/triton/wquant.py); on the CPU the C++ kernel where it takes the
    weight (kernels/wquant_cpu.py: it reads the stored bytes), else the reference
    (dequantize on every call, then multiply). Costs: bench/results/wquant_gemm_cpu.md.
    An act-order INT4 weight (GPTQ desc_act), whose groups the kernel cannot read as
    runs, is kept with its inputs in group order instead (input_order: x's columns
    are gathered into that order per call)."""

    def __init__(self, weight: WQuantWeight, cpu_kernel: bool = False):
        self.input_order: torch.Tensor | None = None
        if cpu_kernel and isinstance(weight, wquant.Int4Weight) and (runs := in_group_order(weight)):
            if wquant_cpu.takes(runs[0]):
                weight, self.input_order = runs
        self.weight = weight
        self.out_features, self.in_features = weight.out_features, weight.in_features
        self.cpu_op = wquant_cpu.multiply if cpu_kernel and wquant_cpu.takes(weight) else wquant.wquant_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        if x.device.type == "cuda":
            from kernels.triton import wquant as triton_wquant

            return triton_wquant.wquant_linear(x, self.weight)
        return self.cpu_op(x, self.weight)


class Concat:
    """Projections side by side, outputs concatenated: a fused projection whose parts
    cannot share one weight (GGUF blocks of different formats)."""

    def __init__(self, parts: list[Projection]):
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def place(weight: Weight, device: torch.device, dtype: torch.dtype) -> Weight:
    """A weight on the device: a tensor in the model's dtype, quantized blocks as they are."""
    if isinstance(weight, torch.Tensor):
        return weight.to(device=device, dtype=dtype)
    return weight.to(device)


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight's values as a tensor of `dtype` (quantized blocks dequantized): what the
    norms and biases are kept as."""
    values = weight if isinstance(weight, torch.Tensor) else weight.dequantize()
    return values.to(dtype)


def embed_rows(table: Weight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embeddings of `ids` [T] -> [T, hidden] in `dtype`: rows of the table, or of its
    quantized blocks decoded (the same values as `dense` of the whole table)."""
    if isinstance(table, QuantizedWeight):
        return table.rows(ids).dequantize().to(dtype)
    return F.embedding(ids, table if isinstance(table, torch.Tensor) else dense(table, dtype))


def make_linear(
    parts: Sequence[Weight], cpu_kernel: bool = False, quant_activations: str = "none", shared: bool = False
) -> Projection:
    """The projection by the parts' rows stacked (q, k, v: one matmul): one Linear over
    tensors, one QuantLinear over blocks of one format, else one per part.
    quant_activations, shared: QuantLinear's activations and shared."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        tensors = [p for p in parts if isinstance(p, torch.Tensor)]
        return Linear(tensors[0] if len(tensors) == 1 else torch.cat(tensors), cpu_kernel=cpu_kernel)
    scaled = [p for p in parts if isinstance(p, (wquant.ScaledWeight, wquant.Int4Weight))]
    if len(scaled) == len(parts) and (stacked_w := wquant.stack(scaled)) is not None:
        return WQuantLinear(stacked_w, cpu_kernel)
    blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
    stacked = stack(blocks) if len(blocks) == len(parts) else None
    if stacked is not None:
        return QuantLinear(stacked, cpu_kernel, quant_activations, shared)
    return Concat([make_linear([p], cpu_kernel, quant_activations, shared) for p in parts])


def gated_linear(
    gate: Weight, up: Weight, activation: str, cpu_kernel: bool = False, quant_activations: str = "none"
) -> Projection:
    """act(x @ gate.T) * (x @ up.T): GatedLinear over tensors, else the activation after
    make_linear's projection."""
    if isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor):
        return GatedLinear(torch.cat([gate, up]), activation, cpu_kernel=cpu_kernel)
    return Gated(make_linear([gate, up], cpu_kernel, quant_activations), activation, cpu_kernel)
