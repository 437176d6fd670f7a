"""--quant-activations int8 on a worker (issue 38): it reaches every linear over GGUF
blocks, the fused forward's C++ kernel gives the tokens of the per-op forward's torch
reference (kernels/gguf_quant.py's quant_linear_int8), and it is refused where it would
mean nothing."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from kernels import cpu_ops
from kernels.quant_cpu_ops import Int8Panels
from tests.helpers.checkpoints import tiny_checkpoint
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.gguf_tokens import BLOCK_SIZE, worker_tokens
from worker_svc.config import WorkerConfig
from worker_svc.models.linear import QuantLinear
from worker_svc.worker import Worker


def int8_worker(path, eager: bool) -> Worker:
    config = WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE, enforce_eager=eager)
    config.quant_activations = "int8"
    return Worker(config)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])  # the AVX2 tiles, the generic path
def test_int8_reaches_every_quantized_linear_and_the_kernel_gives_the_reference_tokens(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=5, overrides={"output.weight": "Q8_0"})
    with capture_logs() as logs:
        fused = int8_worker(path, eager=False)
    [started] = [e for e in logs if e["event"] == "worker compute"]
    assert started["quant_activations"] == "int8"
    layer = fused.model.layers[0]
    for projection in (layer.qkv, layer.o, layer.gate_up.linear, layer.down, fused.model.lm_head):  # type: ignore[attr-defined]
        assert isinstance(projection, QuantLinear) and projection.int8
        assert projection.kernel == ("cpu" if cpu_ops.available() else "")
    assert worker_tokens(fused) == worker_tokens(int8_worker(path, eager=True))


@pytest.mark.skipif(
    not cpu_ops.available() or not torch.ops.pagedserve_cpu.int8_pack_lanes("Q4_1"),
    reason="the C++ CPU kernels could not be built here, or without AVX2 (no panels)",
)
@pytest.mark.parametrize("tied", [True, False])
def test_int8_packs_the_weights_at_load_but_a_tied_head_and_gives_the_same_tokens(tmp_path, tied):
    """Q4_1's projections packed into panels (quant_cpu_ops.Int8Panels) at load; a tied
    head stays in the file's layout, which the embedding reads rows of. The tokens are
    the per-op forward's, which multiplies the file's blocks with the torch reference."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", "Q4_1", seed=6, tied=tied)
    fused = int8_worker(path, eager=False)
    layer = fused.model.layers[0]
    for projection in (layer.qkv, layer.o, layer.gate_up.linear, layer.down):  # type: ignore[attr-defined]
        assert isinstance(projection.weight, Int8Panels) and projection.weight.format == "Q4_1"
    head = fused.model.lm_head
    assert isinstance(head, QuantLinear) and isinstance(head.weight, Int8Panels) is not tied
    if tied:
        assert head.weight is fused.model.embed
    assert worker_tokens(fused) == worker_tokens(int8_worker(path, eager=True))


def test_int8_is_refused_without_gguf_blocks_or_over_ranks():
    config = WorkerConfig(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=8)
    config.quant_activations = "int8"
    with pytest.raises(ValueError, match="--quant-activations int8: the model has no GGUF block weights"):
        Worker(config)
    config.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="--quant-activations"):
        config.validate()
