"""RoPE tables (worker_svc/models/rope.py) against transformers' own, for every rope
type we serve, and the partial-rotary permutation against transformers' partial
rotation: the same attention scores."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

from kernels.reference import apply_rope
from tests.helpers.checkpoints import tiny_checkpoint
from tools.tiny_checkpoints import LONGROPE
from worker_svc.models import load_spec
from worker_svc.models.rope import partial_rotary_permutation, rope_cos_sin, rope_table

HEAD_DIM = 16
PARAMS = [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64},
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
        "truncate": False,
    },
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: p["rope_type"] + str(len(p)))
def test_tables_equal_transformers(params):
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=512, rope_parameters=params
    )
    theirs, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    ours = rope_table(dict(config.rope_parameters), HEAD_DIM, HEAD_DIM, 512)
    assert torch.equal(torch.tensor(ours.inv_freq), theirs.float())
    assert ours.attention_factor == pytest.approx(factor, rel=1e-12)


def test_the_tiny_llama3_table_equals_transformers():
    config = AutoConfig.from_pretrained(tiny_checkpoint("llama"))
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    ours = rope_table(dict(config.rope_parameters), HEAD_DIM, HEAD_DIM, config.max_position_embeddings)
    assert torch.equal(torch.tensor(ours.inv_freq), theirs.float())


def test_longrope_serves_its_short_factors_up_to_the_original_length():
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_parameters=dict(LONGROPE),  # the tiny Phi-3's: partial rotary 0.5, 4 factors each
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config, torch.device("cpu"))
    ours = rope_table(dict(config.rope_parameters), HEAD_DIM, 8, 512)
    assert torch.equal(torch.tensor(ours.inv_freq[:4]), short) and ours.inv_freq[4:] == (0.0,) * 4
    assert ours.max_len == 64 and ours.attention_factor == factor != 1.0
    cos, sin = rope_cos_sin(torch.tensor([0, 63]), ours, torch.tensor(ours.inv_freq), torch.float32)
    assert torch.equal(cos[1, :4], (63 * short).cos() * factor)
    # pass-through dims: neither rotated nor scaled by the attention factor
    assert torch.equal(cos[:, 4:8], torch.ones(2, 4)) and torch.equal(sin[:, 4:8], torch.zeros(2, 4))


@pytest.mark.parametrize("rotary_dim", [8, 12])
def test_permuted_partial_rotary_gives_transformers_scores(rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    q, k = torch.randn(5, 2, HEAD_DIM, generator=gen), torch.randn(5, 2, HEAD_DIM, generator=gen)
    table = rope_table({"rope_type": "default", "rope_theta": 10000.0}, HEAD_DIM, rotary_dim, 512)
    inv = torch.tensor(table.inv_freq)
    positions = torch.arange(5) * 7
    cos, sin = rope_cos_sin(positions, table, inv, torch.float32)
    order = partial_rotary_permutation(HEAD_DIM, rotary_dim)
    ours_q, ours_k = apply_rope(q[..., order], cos, sin), apply_rope(k[..., order], cos, sin)
    freqs = positions.float()[:, None] * inv[None, : rotary_dim // 2]
    emb = torch.cat((freqs, freqs), dim=-1)
    their_q, their_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin(), unsqueeze_dim=1)
    torch.testing.assert_close(
        torch.einsum("thd,shd->hts", ours_q, ours_k), torch.einsum("thd,shd->hts", their_q, their_k), rtol=0, atol=1e-5
    )
    assert torch.equal(ours_q[..., order.argsort()][..., rotary_dim:], q[..., rotary_dim:])  # untouched


def test_a_longrope_model_is_served_only_up_to_its_original_context():
    """Past original_max_position_embeddings transformers switches the whole sequence
    to the long factors (a 140-token prompt's first 100 positions differ from the
    100-token prompt's), which a paged cache filled with the short ones cannot follow:
    max_model_len stops at the original context (docs/design.md, RoPE)."""
    path = tiny_checkpoint("phi3")
    config = AutoConfig.from_pretrained(path)
    assert load_spec(path).max_model_len == config.original_max_position_embeddings == 128
    assert config.max_position_embeddings > 128
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(4, 700, (1, 140), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        short, long = model(ids[:, :100]).logits, model(ids).logits[:, :100]
    assert not torch.allclose(short, long, atol=1e-3)
