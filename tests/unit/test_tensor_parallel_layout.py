"""Which heads, MLP columns and vocabulary rows each tensor-parallel rank holds
(worker_svc/parallel/layout.py), the checkpoint slices that follow from it
(sharding.py, checked against the full tensors), and the start-up check naming
--tensor-parallel-size."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.checkpoints import tiny_checkpoint
from worker_svc.config import WorkerConfig
from worker_svc.models import load_spec
from worker_svc.parallel.layout import RankLayout, layout_problem
from worker_svc.parallel.sharding import rank_layout, shard_checkpoint


def layouts(q: int, kv: int, size: int, inter: int = 128, vocab: int = 768) -> list[RankLayout]:
    return [RankLayout(r, size, q, kv, inter, vocab) for r in range(size)]


def test_heads_split_evenly_or_kv_heads_replicate():
    # GQA, as many KV heads as ranks or more: each rank its own.
    assert [(list(x.q_heads), list(x.kv_heads)) for x in layouts(8, 4, 2)] == [
        ([0, 1, 2, 3], [0, 1]),
        ([4, 5, 6, 7], [2, 3]),
    ]
    # Fewer KV heads than ranks: each KV head on the ranks whose query heads use it.
    assert [(list(x.q_heads), list(x.kv_heads)) for x in layouts(8, 2, 4)] == [
        ([0, 1], [0]),
        ([2, 3], [0]),
        ([4, 5], [1]),
        ([6, 7], [1]),
    ]
    assert [list(x.kv_heads) for x in layouts(4, 1, 4)] == [[0]] * 4  # MQA
    for x in layouts(16, 4, 8):  # every query head's KV head (q // group) is local
        assert all(q // 4 in x.kv_heads for q in x.q_heads)
    assert [list(x.mlp_columns) for x in layouts(4, 2, 2, inter=6)] == [[0, 1, 2], [3, 4, 5]]
    assert [(x.vocab_rows.start, x.vocab_rows.stop) for x in layouts(4, 2, 4, vocab=10)] == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 12),  # rows 10 and 11 are padding
    ]


@pytest.mark.parametrize(
    ("q", "kv", "inter", "size", "why"),
    [
        (4, 2, 128, 3, "attention heads"),
        (8, 4, 128, 8, None),
        (16, 3, 128, 4, "multiple of the model's 3 KV heads"),
        (8, 6, 128, 4, "divisor of the model's 6 KV heads"),
        (8, 2, 130, 4, "MLP width 130"),
        (4, 1, 128, 4, None),
    ],
)
def test_layout_problems(q, kv, inter, size, why):
    problem = layout_problem(q, kv, inter, size)
    assert (problem is None) if why is None else (why in problem)


def test_the_start_up_check_names_the_flag():
    llama = str(tiny_checkpoint("llama"))  # 4 attention heads, 2 KV heads
    WorkerConfig(model=llama, tensor_parallel_size=4).validate()
    with pytest.raises(ValueError, match="--tensor-parallel-size: must be a divisor of the model's 4 attention heads"):
        WorkerConfig(model=llama, tensor_parallel_size=3).validate()
    with pytest.raises(ValueError, match="--tensor-parallel-size: must be >= 1"):
        WorkerConfig(model=llama, tensor_parallel_size=0).validate()


@pytest.mark.parametrize(("family", "size"), [("llama", 2), ("llama", 4), ("qwen3_mqa", 4), ("gemma3", 2)])
def test_rank_slices_put_back_together_are_the_checkpoint(family, size):
    """Column-parallel slices stacked, row-parallel ones side by side, and the vocabulary
    slices in order give back every full tensor; a replicated KV head is the same on
    the ranks that share it; the rank's spec has its own head counts."""
    model_dir = tiny_checkpoint(family)
    spec, full = load_spec(model_dir), load_file(model_dir / "model.safetensors")
    shards = [shard_checkpoint(spec, dict(full), rank_layout(spec, r, size)) for r in range(size)]
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    for name in (attn + "q_proj.weight", mlp + "gate_proj.weight", mlp + "up_proj.weight"):
        assert torch.equal(torch.cat([t[name] for _, t in shards]), full[name])
    for name in (attn + "o_proj.weight", mlp + "down_proj.weight"):
        assert torch.equal(torch.cat([t[name] for _, t in shards], dim=1), full[name])
    heads = {}
    for r, (_, tensors) in enumerate(shards):
        kv_heads = rank_layout(spec, r, size).kv_heads
        for i, h in enumerate(kv_heads):
            rows = slice(i * spec.head_dim, (i + 1) * spec.head_dim)
            heads.setdefault(h, []).append(tensors[attn + "k_proj.weight"][rows])
    assert sorted(heads) == list(range(spec.num_kv_heads))
    for h, copies in heads.items():
        assert all(
            torch.equal(c, full[attn + "k_proj.weight"][h * spec.head_dim : (h + 1) * spec.head_dim]) for c in copies
        )
    vocab = torch.cat([t["lm_head.weight"] for _, t in shards])[: spec.vocab_size]
    head = full["model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"]
    assert torch.equal(vocab, head)
    local = shards[0][0]
    assert (local.num_q_heads, local.intermediate_size) == (spec.num_q_heads // size, spec.intermediate_size // size)
    assert local.num_kv_heads == max(1, spec.num_kv_heads // size) and not local.tie_word_embeddings
    assert torch.equal(shards[0][1]["model.embed_tokens.weight"], full["model.embed_tokens.weight"])  # replicated
