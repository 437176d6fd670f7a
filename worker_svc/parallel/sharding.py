"""One rank's slice of a checkpoint (Megatron's split, layout.py says which part).

Column-parallel (output rows split): q/k/v and gate/up projections, each rank
computing its heads and its MLP columns. Row-parallel (input columns split):
o and down projections, whose partial outputs the ranks sum (one all-reduce
each, layers.py). The output projection is split by vocabulary (the rank's
logits slice, gathered on rank 0 for sampling). Norms, the embedding and
everything else are replicated. A mixture-of-experts block splits each expert as
a dense MLP (its width), and a shared expert (Qwen2-MoE) as the dense MLP it is,
keeps the router and the shared expert's scalar gate whole, and sums its output
(one all-reduce).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_svc.models import DecoderModel
from worker_svc.models.decoder import ProjectionHook
from worker_svc.models.errors import UnsupportedModel
from worker_svc.models.moe import MoeSpec
from worker_svc.models.spec import ModelSpec
from worker_svc.models.weights import Tensors
from worker_svc.parallel.layers import RowParallel, VocabParallelHead
from worker_svc.parallel.layout import RankLayout

if TYPE_CHECKING:
    from worker_svc.parallel.group import TensorParallelGroup


def load_rank_model(
    model_dir: str, dtype: torch.dtype, group: TensorParallelGroup, hook: ProjectionHook | None = None
) -> DecoderModel:
    """This rank's shard of the checkpoint, with the collectives in its projections
    (around what `hook` made of them: a LoRA's partial sums are reduced with the base's)."""
    model = DecoderModel.load(
        model_dir,
        dtype,
        group.device,
        transform=lambda spec, tensors: shard_checkpoint(spec, tensors, rank_layout(spec, group.rank, group.size)),
        hook=hook,
    )
    for layer in model.layers:
        layer.o = RowParallel(layer.o, group)
        if layer.down is not None:
            layer.down = RowParallel(layer.down, group)
        if layer.moe is not None:  # each rank's experts give a partial sum over their columns
            layer.moe = RowParallel(layer.moe, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, model.spec.vocab_size)
    return model


@dataclass(frozen=True)
class LoraSplit:
    """A rank's part of a LoRA adapter, split as the base weights are: B's rows of the
    column-parallel q/k/v and gate/up (A whole), A's columns of the row-parallel o and
    down (B whole: the rank's partial product joins the base's in its all-reduce)."""

    layout: RankLayout
    head_dim: int

    def _parts(self, module: str) -> tuple[slice | None, slice | None]:
        """(B's rows, A's columns) of this rank; None: whole."""
        q, kv = _rows(self.layout.q_heads, self.head_dim), _rows(self.layout.kv_heads, self.head_dim)
        mlp = _rows(self.layout.mlp_columns, 1)
        return {
            "q_proj": (q, None),
            "k_proj": (kv, None),
            "v_proj": (kv, None),
            "gate_proj": (mlp, None),
            "up_proj": (mlp, None),
            "o_proj": (None, q),
            "down_proj": (None, mlp),
        }[module]

    def shape(self, module: str, whole: tuple[int, int]) -> tuple[int, int]:
        rows, columns = self._parts(module)
        return (
            whole[0] if rows is None else rows.stop - rows.start,
            whole[1] if columns is None else columns.stop - columns.start,
        )

    def split(self, module: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, columns = self._parts(module)
        return (a if columns is None else a[:, columns]), (b if rows is None else b[rows])


def lora_split(spec: ModelSpec, group: TensorParallelGroup) -> LoraSplit:
    return LoraSplit(rank_layout(spec, group.rank, group.size), spec.head_dim)


def rank_layout(spec: ModelSpec, rank: int, size: int) -> RankLayout:
    return RankLayout(rank, size, spec.num_q_heads, spec.num_kv_heads, spec.intermediate_size, spec.vocab_size)


def shard_checkpoint(spec: ModelSpec, tensors: Tensors, layout: RankLayout) -> tuple[ModelSpec, Tensors]:
    """The rank's spec (its head counts and MLP width; the output projection its
    own, untied) and its tensors, sliced in place of the full ones. A column-parallel
    bias is sliced with its rows; a row-parallel one (o, down) is added once, by
    rank 0: the others' are zeros, as the all-reduce sums every rank's output."""
    if spec.qk_norm == "full":
        raise UnsupportedModel(
            f"{spec.model_type}: --tensor-parallel-size > 1 is not supported: its q/k norms span every rank's heads"
        )
    d = spec.head_dim
    q = _rows(layout.q_heads, d)
    kv = _rows(layout.kv_heads, d)
    mlp = _rows(layout.mlp_columns, 1)
    for i in range(spec.num_layers):
        attn, ffn = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for name, rows in (
            (attn + "q_proj", q),
            (attn + "k_proj", kv),
            (attn + "v_proj", kv),
            (ffn + "gate_proj", mlp),
            (ffn + "up_proj", mlp),
        ):
            for kind in ("weight", "bias"):
                if f"{name}.{kind}" in tensors:
                    tensors[f"{name}.{kind}"] = tensors[f"{name}.{kind}"][rows]
        for name, columns in ((attn + "o_proj", q), (ffn + "down_proj", mlp)):
            if name + ".weight" not in tensors:  # a mixture-of-experts layer's (_shard_experts)
                continue
            tensors[name + ".weight"] = tensors[name + ".weight"][:, columns].contiguous()
            if name + ".bias" in tensors and layout.rank != 0:
                tensors[name + ".bias"] = torch.zeros_like(tensors[name + ".bias"])
    moe = _shard_experts(spec, tensors, layout)
    tied = spec.tie_word_embeddings or "lm_head.weight" not in tensors
    head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
    tensors["lm_head.weight"] = _vocab_slice(head, layout.vocab_rows)
    local = dataclasses.replace(
        spec,
        num_q_heads=len(layout.q_heads),
        num_kv_heads=len(layout.kv_heads),
        intermediate_size=len(layout.mlp_columns),
        tie_word_embeddings=False,
        moe=moe,
    )
    return local, tensors


def _shard_experts(spec: ModelSpec, tensors: Tensors, layout: RankLayout) -> MoeSpec | None:
    """Each expert split as a dense MLP is (its gate/up rows, its down columns) over
    the expert's own width, the shared expert over its own; the router and the
    shared expert's gate are replicated. The rank's MoeSpec."""
    if spec.moe is None:
        return None
    moe = spec.moe
    width, shared = moe.intermediate_size, moe.shared_intermediate_size
    for what, size in (("experts' width", width), ("shared expert's width", shared)):
        if size % layout.size:
            raise UnsupportedModel(
                f"{spec.model_type}: --tensor-parallel-size {layout.size} does not divide the {what} {size}"
            )
    for i, sparse in enumerate(moe.sparse_layers):
        experts = [f"model.layers.{i}.mlp.experts.{e}." for e in range(moe.num_experts if sparse else 0)]
        for expert in experts:
            _shard_mlp(tensors, expert, layout, width)
        if sparse and shared:
            _shard_mlp(tensors, f"model.layers.{i}.mlp.shared_expert.", layout, shared)
    return dataclasses.replace(
        moe, intermediate_size=width // layout.size, shared_intermediate_size=shared // layout.size
    )


def _shard_mlp(tensors: Tensors, prefix: str, layout: RankLayout, width: int) -> None:
    """The rank's gate/up rows and down columns of the gated MLP at `prefix`, `width` wide."""
    columns = _rows(dataclasses.replace(layout, intermediate_size=width).mlp_columns, 1)
    for name in ("gate_proj", "up_proj"):
        tensors[prefix + name + ".weight"] = tensors[prefix + name + ".weight"][columns]
    tensors[prefix + "down_proj.weight"] = tensors[prefix + "down_proj.weight"][:, columns].contiguous()


def _rows(units: range, width: int) -> slice:
    return slice(units.start * width, units.stop * width)


def _vocab_slice(weight: torch.Tensor, rows: range) -> torch.Tensor:
    """Rows `rows` of the [vocab, hidden] projection; rows past the vocabulary are zeros."""
    part = weight[rows.start : rows.stop]
    missing = len(rows) - part.shape[0]
    if missing:
        part = torch.cat([part, part.new_zeros(missing, weight.shape[1])])
    return part.clone()  # not a view: the full matrix can be freed
