"""Tensor parallelism inside one worker (--tensor-parallel-size N): N ranks on
torch.distributed, each holding a Megatron-style shard of the weights and its
share of every KV block. See docs/design.md, "Tensor parallelism"."""
