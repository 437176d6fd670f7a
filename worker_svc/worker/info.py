"""What a worker tells the scheduler about itself (worker.v1 Info): its model, its
pool, where and how it computes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    model_name: str
    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_dtype: str
    dtype: str
    device: str
    instance_id: str
    kv_bytes_per_block: int  # all layers, K and V, scales included
    sliding_window: int
    attention_backend: str
    kv_bytes_per_token: int  # kv_bytes_per_block / block_size
    kv_scale_bytes_per_block: int  # the scales' and zero points' share of kv_bytes_per_block
    kv_dtype_requested: str  # --kv-dtype as configured; kv_dtype is what it resolved to
    kv_layout: str = "paged"  # contiguous: num_blocks = slots, block_size = max_seq_len
    max_batch: int = 0  # contiguous: slots (sequences at once); paged: 0, no limit
    tensor_parallel_size: int = 1
    kv_bytes_per_block_per_rank: int = 0  # one rank's share; kv_bytes_per_block counts every rank
    max_num_seqs: int = 0  # --max-num-seqs: the largest decode batch sized for (the scheduler's default)
    hidden_size: int = 0  # a pooling row's vector length
    num_offload_blocks: int = 0  # the second KV tier's blocks (--kv-offload-gb); 0: none
    offload_medium: str = ""  # where it lives: "CPU" (pinned host memory) or "DISK" (file-backed)
    max_loras: int = 0  # --enable-lora: adapter slots 1..max_loras (0: LoRA off)
    max_lora_rank: int = 0
    kv_role: str = "both"  # --kv-role: prefill | decode | both (disaggregation)
    weight_format: str = ""  # float32 | bfloat16 | "gguf Q4_1+Q8_0": the weights as stored
    weights_bytes: int = 0  # the weights' bytes in this worker's memory, as served
