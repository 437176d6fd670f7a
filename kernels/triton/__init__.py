"""The Triton op set: one module per op family, each op with the signature and
semantics of its torch reference in kernels/reference.py (that module's docstring
has the cache layout and the varlen conventions), so an attention backend, the
sampler and the tests take this package where they take the reference.

* kv_write.py: write_kv; kv_quant.py: the quantized cache's arithmetic inside
  the kernels (the write's quantization, the read's dequantization).
* attention.py: paged and contiguous prefill/decode attention and split-KV
  decode; attention_kernel.py: the kernel bodies; launch.py: tiles
  and split counts, as pure arithmetic.
* fused.py: add_rms_norm and rope_write_kv (RoPE fused with the K/V write).
* sampling.py: gumbel_argmax, the seeded Gumbel-max sample in one pass.
* gguf_gemm.py: quant_linear over GGUF's quantized blocks (kernels/gguf_quant.py's
  oracle), which a QuantLinear on CUDA calls (worker_svc/models/linear.py).

Kernels run compiled on CUDA (matmuls in the query dtype, fp32 accumulation), or
under the Triton interpreter on CPU tensors (``TRITON_INTERPRET=1`` set before
this package is imported, as tests/conftest.py does). Under the interpreter
everything is cast to fp32 right after loading: its bf16 arithmetic works on the
raw uint16 bits and is garbage otherwise.
"""

from __future__ import annotations

from kernels import reference
from kernels.triton.attention import (
    contiguous_decode_attention,
    contiguous_prefill_attention,
    paged_decode_attention,
    paged_prefill_attention,
    split_kv_decode_attention,
)
from kernels.triton.common import interpreter_enabled
from kernels.triton.fused import add_rms_norm, rope_write_kv
from kernels.triton.kv_write import write_kv
from kernels.triton.launch import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    AttentionTiles,
    attention_launch,
    attention_tiles,
    num_kv_splits,
    num_sms,
)
from kernels.triton.sampling import gumbel_argmax

# Whole-block copies (values, and the scales of a quantized cache) are plain
# tensor indexing: no kernel needed.
copy_blocks = reference.copy_blocks

__all__ = [
    "MAX_SPLITS",
    "MIN_SPLIT_TOKENS",
    "AttentionTiles",
    "add_rms_norm",
    "attention_launch",
    "attention_tiles",
    "contiguous_decode_attention",
    "contiguous_prefill_attention",
    "copy_blocks",
    "gumbel_argmax",
    "interpreter_enabled",
    "num_kv_splits",
    "num_sms",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rope_write_kv",
    "split_kv_decode_attention",
    "write_kv",
]
