"""The tiny checkpoints load in transformers as the architecture they claim, are
deterministic, and behave like a (random) language model rather than a constant."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tools import tiny_checkpoints as tc
from tools import tiny_tokenizer as tt

FAMILIES = sorted(tc.FAMILIES)
EXPECTED = {  # family -> (model_type, kv heads, tied embeddings)
    "llama": ("llama", 2, True),
    "llama_mqa": ("llama", 1, False),
    "qwen3": ("qwen3", 2, False),
    "qwen3_mqa": ("qwen3", 1, False),
    "gemma3": ("gemma3_text", 2, True),
    "gemma3_mqa": ("gemma3_text", 1, True),
    "llama_long": ("llama", 1, True),
    "llama_bias": ("llama", 2, False),
    "qwen2": ("qwen2", 2, False),
    "mistral": ("mistral", 2, False),
    "phi3": ("phi3", 2, False),
    "gemma2": ("gemma2", 2, True),
    "olmo2": ("olmo2", 2, False),
    "granite": ("granite", 2, False),
    "qwen3_moe": ("qwen3_moe", 2, False),
    "qwen2_moe": ("qwen2_moe", 2, False),
    "mixtral": ("mixtral", 2, False),
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every family built twice, into two separate directories."""
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    return {f: (tc.build_checkpoint(f, a / f), tc.build_checkpoint(f, b / f)) for f in FAMILIES}


def test_families_are_the_documented_ones():
    assert set(tc.FAMILIES) == set(EXPECTED)


@pytest.mark.parametrize("family", FAMILIES)
def test_loads_generates_and_matches_config(builds, family):
    path = builds[family][0]
    model_type, kv_heads, tied = EXPECTED[family]
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == model_type
    assert config.num_key_value_heads == kv_heads < config.num_attention_heads
    assert config.tie_word_embeddings is tied
    assert config.head_dim == 16
    tok = AutoTokenizer.from_pretrained(path)
    assert config.vocab_size == len(tok)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    # verify_checkpoint asserts no missing/unexpected keys, the unicode round-trip
    # and a non-degenerate greedy continuation.
    tokens = tc.verify_checkpoint(path)
    assert tokens == tc.verify_checkpoint(builds[family][1])


@pytest.mark.parametrize("family", FAMILIES)
def test_builds_are_byte_identical(builds, family):
    a, b = builds[family]
    names = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in names and "generation_config.json" in names
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tokenizer_training_is_deterministic():
    assert tt.train_tokenizer_json() == tt.train_tokenizer_json()


def test_tokenizer_roundtrip_and_chat_template(builds):
    tok = AutoTokenizer.from_pretrained(builds["qwen3"][0])
    assert 512 <= len(tok) <= 1024
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == (tt.UNK, tt.BOS, tt.EOS, tt.PAD)
    for text in [tc.UNICODE_SAMPLE, "日本語のテキスト ✓ \x00\t\n  spaces", "def f(x):\n    return x ** 2\n"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    assert ids.count(tok.bos_token_id) == 2 and ids.count(tok.eos_token_id) == 1


@pytest.mark.parametrize("family", ["gemma3", "gemma3_mqa"])
def test_gemma3_mixes_sliding_and_full_layers(builds, family):
    config = AutoConfig.from_pretrained(builds[family][0])
    assert config.sliding_window < 32
    assert config.layer_types.count("sliding_attention") >= 1
    assert config.layer_types.count("full_attention") >= 1
    assert config.query_pre_attn_scalar != config.head_dim
    rope = config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]
    assert rope["full_attention"]["rope_type"] == "linear"


def test_gemma3_sliding_window_changes_the_output(builds):
    """Prompts well past the window must give different logits than full attention."""
    path = builds["gemma3"][0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(path)(tt.CORPUS[:200], return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 4 * model.config.sliding_window
    with torch.no_grad():
        windowed = model(ids).logits
        model.config.sliding_window = 10_000
        full = model(ids).logits
    w = 8
    assert torch.allclose(windowed[:, :w], full[:, :w], atol=1e-4)
    assert not torch.allclose(windowed[:, w:], full[:, w:], atol=1e-2)


def test_llama3_rope_scaling_changes_frequencies(builds):
    config = AutoConfig.from_pretrained(builds["llama"][0])
    assert config.rope_parameters["rope_type"] == "llama3"
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, 16, 2).float() / 16)
    changed = ~torch.isclose(scaled, plain)
    assert changed.any() and not changed.all()


def test_logits_have_spread(builds):
    for family in FAMILIES:
        path = builds[family][0]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = AutoTokenizer.from_pretrained(path)(tt.CORPUS[:200], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0]
        assert torch.isfinite(logits).all()
        assert logits.std(-1).mean() > 1.0, family


@pytest.mark.parametrize("family", sorted(tc.DENSE_FAMILIES))
def test_biases_and_norms_are_not_trivial(builds, family):
    """HF initialises biases to zero and norms to one, which would hide a dropped
    bias or a misplaced norm: every one of them is drawn away from that."""
    from safetensors.torch import load_file

    tensors = load_file(builds[family][0] / "model.safetensors")
    offset = 1.0 if family.startswith("gemma") else 0.0  # Gemma stores w - 1
    for name, t in tensors.items():
        if name.endswith(".bias"):
            assert t.std() > 0.1, name
        elif "norm" in name and name != "model.norm.weight":
            assert (t + offset - 1.0).abs().max() > 0.05, name
    assert any(n.endswith(".bias") for n in tensors) == (family in ("llama_bias", "qwen2", "olmo2", "granite"))


def test_ensure_checkpoint_caches_and_rebuilds_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TINY_CKPT_DIR", str(tmp_path))
    path = tc.ensure_checkpoint("llama_mqa")
    assert path == tmp_path / "llama_mqa"
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tc.ensure_checkpoint("llama_mqa") == path
    assert weights.stat().st_mtime_ns == mtime  # not rebuilt
    (path / tc.MARKER).write_text("stale\n")
    tc.ensure_checkpoint("llama_mqa")
    assert (path / tc.MARKER).read_text().strip() == tc.VERSION
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["llama_mqa"]
    with pytest.raises(KeyError):
        tc.ensure_checkpoint("gpt2")
