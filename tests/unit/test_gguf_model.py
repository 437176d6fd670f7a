"""A GGUF file as the worker's model (issue 38): every served block format, fp32,
gives transformers' greedy tokens on the same file (transformers dequantizes it with
the gguf package), through the C++ kernels where they take the format and the
reference elsewhere; the linear weights stay in the file's blocks; what is not
served is refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGUFReader
from structlog.testing import capture_logs
from transformers import AutoConfig

from kernels import cpu_ops
from kernels.gguf_quant import BLOCK_FORMATS, QuantizedWeight
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.gguf_tokens import BLOCK_SIZE, LONG_PROMPT, PROMPT, reference_tokens, worker_tokens
from worker_svc.config import WorkerConfig
from worker_svc.models.linear import Concat, QuantLinear
from worker_svc.worker import Worker


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_fp32_tokens_match_transformers_on_the_same_gguf(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=len(qtype) + ord(qtype[1]))
    worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    assert worker_tokens(worker) == reference_tokens(path)
    layer = worker.model.layers[0]
    assert isinstance(layer.qkv, QuantLinear) and layer.qkv.weight.qtype == qtype
    assert layer.qkv.kernel == ("cpu" if cpu_ops.available() else "")  # the C++ kernel read the blocks
    head, table = worker.model.lm_head, worker.model.embed
    assert isinstance(head, QuantLinear) and isinstance(table, QuantizedWeight)  # tied: the head multiplies
    assert head.weight.data.data_ptr() == table.data.data_ptr()  # the embedding's blocks, not a copy of them


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma2", "gemma3", "phi3"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_more_architectures_match_transformers(tmp_path, architecture, qtype):
    """Qwen2 / Qwen2.5 (q, k, v biases), Qwen3 (q, k norms), Gemma 2 (norms stored as 1 + w,
    sandwich norms, soft-caps, a sliding window), Gemma 3 text (the same but soft-caps, with
    q, k norms), Phi-3 (q, k, v and gate, up fused; its window, which transformers' config
    leaves out, from the file): q and k rows as stored."""
    path = write_tiny_gguf(tmp_path / f"{architecture}-{qtype}.gguf", qtype, seed=11, architecture=architecture)
    for prompt in (PROMPT, LONG_PROMPT):  # a decode's rows, and a prefill's tiles
        worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
        assert worker.model.spec.model_type == {"gemma3": "gemma3_text"}.get(architecture, architecture)
        if architecture == "phi3":
            assert worker.model.spec.sliding_window == 128
        assert worker_tokens(worker, prompt) == reference_tokens(path, prompt)


def test_a_mistral_named_llama_file_has_no_sliding_window(tmp_path):
    """transformers makes a llama-architecture file whose general.name is "mistral" a
    MistralConfig, with its default 4,096-token window; llama.cpp's llama architecture
    applies none (nor do Mistral v0.2+), and neither do we."""
    path = write_tiny_gguf(tmp_path / "mistral.gguf", "Q8_0", seed=5, name="mistral")
    assert AutoConfig.from_pretrained(tmp_path, gguf_file=path.name).sliding_window == 4096
    worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    assert worker.model.spec.model_type == "mistral" and worker.model.spec.sliding_window == 0
    # transformers loads no weights for it ("Unknown gguf model_type: mistral"): the oracle is
    # the same tensors under another name, which transformers reads as the llama file it is
    (tmp_path / "plain").mkdir()
    plain = write_tiny_gguf(tmp_path / "plain" / "llama.gguf", "Q8_0", seed=5)
    assert worker_tokens(worker, LONG_PROMPT) == reference_tokens(plain, LONG_PROMPT)


@pytest.mark.parametrize("qtype", sorted(BLOCK_FORMATS))
def test_a_long_prompt_through_the_prefill_tiles(tmp_path, qtype):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, seed=3 * len(qtype) + ord(qtype[1]))
    worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    assert worker_tokens(worker, LONG_PROMPT) == reference_tokens(path, LONG_PROMPT)


def test_mixed_formats_and_an_untied_head(tmp_path):
    """A Q4_K_M-like file: attn_v and ffn_down in Q6_K, the head in Q8_0, one weight plain
    fp32 (F32 tensors are served too)."""
    overrides = {
        "attn_v.weight": "Q6_K",
        "ffn_down.weight": "Q6_K",
        "output.weight": "Q8_0",
        "blk.1.ffn_up.weight": "F32",
    }
    path = write_tiny_gguf(tmp_path / "mixed.gguf", "Q4_K", seed=7, tied=False, overrides=overrides)
    for eager in (False, True):  # the fused forward (C++ ops where they take the format) and the per-op one
        with capture_logs() as logs:
            worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE,
                                         enforce_eager=eager))  # fmt: skip
        [started] = [e for e in logs if e["event"] == "worker compute"]
        assert started["weights"] == "gguf Q4_K+Q6_K+Q8_0"
        assert worker_tokens(worker) == reference_tokens(path)
        assert isinstance(worker.model.layers[0].qkv, Concat)  # q, k in Q4_K; v in Q6_K
        head = worker.model.lm_head
        assert isinstance(head, QuantLinear) and head.weight.qtype == "Q8_0"
        assert head.kernel == ("" if eager or not cpu_ops.available() else "cpu")


def test_linear_weights_stay_in_their_blocks(tmp_path):
    path = write_tiny_gguf(tmp_path / "q4_0.gguf", "Q4_0", seed=3)
    worker = Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8, block_size=BLOCK_SIZE))
    layer = worker.model.layers[1]
    for projection in (layer.qkv, layer.o, layer.down):
        assert isinstance(projection, QuantLinear) and projection.weight.data.dtype == torch.uint8
    weight: QuantizedWeight = layer.down.weight  # type: ignore[attr-defined]
    assert weight.nbytes == 256 * 512 // 32 * 18  # [hidden, intermediate] in Q4_0: 18 bytes per 32
    # What the worker reports (InfoResponse, the scheduler's gauge): the weights held as the
    # file has them, the embedding table included (its rows are decoded per step, and the
    # tied head multiplies the same blocks), within 10% of the file's tensor bytes.
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    assert worker.info.weight_format == "gguf Q4_0"
    assert abs(worker.info.weights_bytes - file_bytes) <= 0.1 * file_bytes, (worker.info.weights_bytes, file_bytes)


def test_what_is_not_served_is_refused_by_name(tmp_path):
    path = write_tiny_gguf(tmp_path / "q2k.gguf", "Q4_0", overrides={"ffn_gate.weight": "Q2_K"})
    with pytest.raises(ValueError, match=r"blk.0.ffn_gate.weight.*Q2_K"):
        Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8))
    # metadata transformers' config leaves out, against the defaults it takes instead
    misread = {
        "qwen3.attention.key_length is 64, the config's head_dim 128": dict(architecture="qwen3", head_dim=64),
        "gemma2.final_logit_softcapping is 20, the config's final_logit_softcapping 30": dict(
            architecture="gemma2", caps=(50.0, 20.0)
        ),
        "no query_pre_attn_scalar; the config's 256 is not the head_dim 128": dict(architecture="gemma2", head_dim=128),
        "gemma3.rope.scaling.factor is 8, the config has no rope scaling": dict(architecture="gemma3", rope_scaling=8),
        "phi3.rope.dimension_count is 48, the config's rotary dimensions 64": dict(architecture="phi3", rope_dims=48),
    }
    for i, (message, how) in enumerate(misread.items()):
        path = write_tiny_gguf(tmp_path / f"misread-{i}.gguf", "Q8_0", **how)
        with pytest.raises(ValueError, match=re.escape(message)):
            Worker(WorkerConfig(model=str(path), dtype="float32", num_blocks=8))
    other = write_tiny_gguf(tmp_path / "bloom.gguf", "Q8_0", architecture="bloom")
    with pytest.raises(ValueError, match="bloom"):
        Worker(WorkerConfig(model=str(other), dtype="float32", num_blocks=8))
