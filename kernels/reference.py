"""Pure-torch reference ops over the paged KV cache.

These are the oracle the Triton kernels are tested against and the CPU
backend of the worker. Cache layout, per layer:

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

A token at position p of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``; its *slot* is ``block * block_size + offset``.
Batches are varlen: sequence s owns the query rows
``cu_query_lens[s]:cu_query_lens[s + 1]``, which are the last tokens of its
``context_lens[s]`` tokens (the KV of the new tokens is written before attention).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, kv_heads, head_dim] into the cache at slot_mapping [T];
    slots < 0 are skipped."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value[keep].to(v_cache.dtype)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, kv_heads, bs, d] x [S, max_blocks] -> [S, kv_heads, max_blocks*bs, d]."""
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, block_size, head_dim = cache.shape
    gathered = cache[block_tables.long()]  # [S, max_blocks, kv_heads, bs, d]
    return gathered.permute(0, 2, 1, 3, 4).reshape(num_seqs, num_kv_heads, max_blocks * block_size, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    query [T, q_heads, d]; block_tables [S, max_blocks] (padding entries may be any
    valid block id); cu_query_lens [S + 1]; context_lens [S] (cached + new tokens).
    A token at position p sees positions j <= p, and with a sliding window W > 0
    only j > p - W. Returns [T, q_heads, d] in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    device = query.device
    query_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens.long(), output_size=num_tokens)
    row_of_token = torch.arange(num_tokens, device=device) - cu_query_lens[:-1].long()[seq_of_token]
    max_query_len = int(query_lens.max())

    # Pad the varlen batch to [S, heads, max_query_len, d]: one SDPA call, no per-sequence loop.
    padded = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded[seq_of_token, row_of_token] = query
    padded = padded.transpose(1, 2)

    keys = gather_context(k_cache, block_tables).to(query.dtype)
    values = gather_context(v_cache, block_tables).to(query.dtype)
    key_pos = torch.arange(keys.shape[2], device=device)
    rows = torch.arange(max_query_len, device=device)
    query_pos = (context_lens - query_lens)[:, None].long() + rows[None, :]  # [S, Qmax]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if sliding_window > 0:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    # Padding rows attend to key 0 so that softmax stays finite; they are dropped below.
    is_padding = rows[None, :] >= query_lens[:, None]
    mask |= is_padding[:, :, None] & (key_pos == 0)[None, None, :]

    out = F.scaled_dot_product_attention(
        padded, keys, values, attn_mask=mask[:, None], scale=scale, enable_gqa=num_heads != keys.shape[1]
    )
    return out.transpose(1, 2)[seq_of_token, row_of_token]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """One query token per sequence (the last of its context_lens[s] tokens).

    query [S, q_heads, d] -> [S, q_heads, d]."""
    num_seqs = query.shape[0]
    cu_query_lens = torch.arange(num_seqs + 1, device=query.device, dtype=torch.int32)
    return paged_prefill_attention(
        query, k_cache, v_cache, block_tables, cu_query_lens, context_lens, scale, sliding_window
    )


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer; caches are [layers, blocks, ...]."""
    k_cache[:, dst] = k_cache[:, src]
    v_cache[:, dst] = v_cache[:, src]
