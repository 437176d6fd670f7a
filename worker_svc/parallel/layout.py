"""Which heads, MLP columns and vocabulary rows each tensor-parallel rank holds.

Pure arithmetic (no torch), shared by the start-up checks and the sharding.
Megatron's split: attention heads and MLP columns are divided evenly, so every
rank runs the same shapes. Query heads split evenly over the ranks; KV heads
too when there are at least as many as ranks, otherwise each KV head is
replicated on the ranks whose query heads use it (GQA/MQA with few KV heads),
so a rank's query heads always find their KV head locally. The vocabulary of
the output projection is split in equal slices, the last padded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RankLayout:
    rank: int
    size: int
    num_q_heads: int  # the model's
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int

    @property
    def q_heads(self) -> range:
        per_rank = self.num_q_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads: its share, or the one head its query heads share."""
        if self.num_kv_heads >= self.size:
            per_rank = self.num_kv_heads // self.size
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        group = self.num_q_heads // self.num_kv_heads  # query heads per KV head
        first = self.q_heads.start // group
        return range(first, first + 1)

    @property
    def mlp_columns(self) -> range:
        per_rank = self.intermediate_size // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def vocab_rows(self) -> range:
        """This rank's slice of the vocabulary; rows past vocab_size are padding."""
        per_rank = -(-self.vocab_size // self.size)
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


def layout_problem(num_q_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> str | None:
    """None if a model with these shapes splits over `size` ranks, else why not."""
    if num_q_heads % size:
        return f"a divisor of the model's {num_q_heads} attention heads"
    if num_kv_heads >= size and num_kv_heads % size:
        return f"a divisor of the model's {num_kv_heads} KV heads (or a multiple of it)"
    if num_kv_heads < size and size % num_kv_heads:
        return f"a multiple of the model's {num_kv_heads} KV heads (or a divisor of it)"
    if intermediate_size % size:
        return f"a divisor of the model's MLP width {intermediate_size}"
    return None
