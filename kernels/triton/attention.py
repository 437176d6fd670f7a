"""Paged (and contiguous) attention over the KV cache, with kernels/reference.py's
signatures and semantics (that module's docstring has the cache layout and the
varlen conventions).

* ``paged_decode_attention`` / ``paged_prefill_attention``: one kernel body
  (``paged_attention_kernel``, attention_kernel.py) that reads K/V straight from the blocks through
  the block table with an online softmax in fp32. A program owns one KV head and
  a tile of query *rows*, where a row is a (token, query head of that KV head's
  group) pair, so GQA/MQA load each K/V tile once for the whole group and both
  matmuls are ``tl.dot`` on [BLOCK_M, ...] tiles (BLOCK_M >= 16, the group is
  padded up to it). Decode is the one-token case: grid (sequence, kv head).
* Split-KV (flash-decoding) decode: when (sequence, KV head) programs cannot fill
  the SMs (``num_kv_splits``), a third grid axis cuts each sequence's visible KV
  tiles into equal partitions; each program writes its unnormalized output, max
  and sum-exp (fp32), and ``merge_splits_kernel`` combines them per (sequence,
  query head) with a log-sum-exp reduction. Same kernel body (GQA, windows,
  dequantization unchanged), only the loop's range and the final store differ.
* Sliding window: the KV loop starts at the KV tile holding the first position
  any row of the tile can see, so tiles wholly outside the window are never
  visited; the loads are also masked to that range, so no slot outside it is read.
* Quantized caches (FP8 e4m3 / INT8, kv_quant.py): the kernel dequantizes every
  K/V tile it loads (``from_cache``). The ``QUANT`` constexpr selects the path,
  so the unquantized kernels compile as before.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from kernels.quant import KVScales, checked_scales
from kernels.triton import launch
from kernels.triton.attention_kernel import merge_splits_kernel, paged_attention_kernel
from kernels.triton.common import LOG2E
from kernels.triton.kv_quant import scale_pointers


def _launch_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    cu_query_lens: Tensor,
    scale: float,
    sliding_window: int,
    decode: bool,
    scales: KVScales | None = None,
    num_splits: int = 1,
    min_split_tokens: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert v_cache.shape == k_cache.shape and v_cache.stride() == k_cache.stride()
    assert k_cache.shape[-1] == head_dim, (query.shape, k_cache.shape)
    num_seqs = block_tables.shape[0]
    assert not decode or num_tokens == num_seqs, "decode takes one query token per sequence"
    assert num_splits >= 1 and (decode or num_splits == 1), f"num_splits {num_splits} (> 1 is for decode)"
    assert softcap >= 0.0, f"softcap {softcap} (0: off)"
    scales = checked_scales(k_cache, v_cache, scales)
    if scales is not None:
        scale_ptrs, scale_strides = scale_pointers(scales), scales.k_scale.stride()
    else:  # the pointer slots take any tensor; they are never read
        scale_ptrs, scale_strides = (k_cache, v_cache, k_cache, v_cache), (0, 0, 0)
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    split = num_splits > 1
    meta, options = launch.attention_launch(
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        query.dtype,
        k_cache.dtype,
        decode,
        sliding_window > 0,
        launch.device_capability(query.device),
        split=split,
        min_split_tokens=min_split_tokens,
        softcap=softcap > 0,
    )
    # Decode: a program per (sequence, kv head[, partition]). Prefill: flat query
    # tiles (see _find_seq), an upper bound on their number that needs no device sync.
    if split:
        part_out = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        part_max = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
        grid: tuple[int, ...] = (num_seqs, num_kv_heads, num_splits)
    else:  # the partial slots take any tensor; they are never written
        part_out = part_max = part_sum = out
        block_q = meta["BLOCK_Q"]
        assert isinstance(block_q, int)
        grid = (num_seqs if decode else num_tokens // block_q + 2 * num_seqs, num_kv_heads)
    paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_query_lens,
        *scale_ptrs,
        part_out,
        part_max,
        part_sum,
        scale / softcap if softcap else scale * LOG2E,
        softcap * LOG2E,
        sliding_window,
        num_seqs,
        num_splits,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        block_tables.stride(0),
        *scale_strides,
        **meta,
        **options,
    )
    if split:
        merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=meta["BLOCK_D"],
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole context.

    query [T, q_heads, d]; block_tables [S, max_blocks]; cu_query_lens [S + 1];
    context_lens [S] (cached + new tokens). A token at position p sees positions
    j <= p, and with a sliding window W > 0 only j > p - W. Returns [T, q_heads, d]
    in query's dtype. A quantized cache is read through its `scales`; softcap > 0
    caps the scores as reference.paged_prefill_attention does."""
    return _launch_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        cu_query_lens,
        scale,
        sliding_window,
        decode=False,
        scales=scales,
        softcap=softcap,
    )


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence (the last of its context_lens[s] tokens).

    query [S, q_heads, d] -> [S, q_heads, d]. Split-KV when the (sequence, KV
    head) programs cannot fill the GPU (num_kv_splits); the table's width bounds
    every context, so the grid needs no device sync, and each sequence takes only
    as many of those partitions as its own length fills (MIN_SPLIT_TOKENS each):
    a captured graph's table is as wide as max_model_len, its sequences are not."""
    num_splits = launch.num_kv_splits(
        block_tables.shape[0], k_cache.shape[1], block_tables.shape[1] * k_cache.shape[2], launch.num_sms(query.device)
    )
    return split_kv_decode_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        scale,
        sliding_window,
        num_splits=num_splits,
        scales=scales,
        min_split_tokens=launch.MIN_SPLIT_TOKENS,
        softcap=softcap,
    )


def split_kv_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    num_splits: int,
    scales: KVScales | None = None,
    min_split_tokens: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """paged_decode_attention with each sequence's visible context cut into
    num_splits partitions of whole KV tiles, one program each, merged by a second
    kernel (log-sum-exp). num_splits 1 is the single-pass kernel. With
    min_split_tokens, a sequence takes fewer partitions where its own context
    would make them shorter than that (0: exactly num_splits)."""
    # cu_query_lens is unused in decode mode; any tensor fills the pointer slot.
    return _launch_attention(
        query,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens,
        scale,
        sliding_window,
        decode=True,
        scales=scales,
        num_splits=num_splits,
        min_split_tokens=min_split_tokens,
        softcap=softcap,
    )


def contiguous_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    cu_query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """reference.contiguous_prefill_attention: a contiguous cache [max_batch, kv_heads,
    max_seq_len, d] is a paged one whose blocks are max_seq_len long, one per
    sequence, so the paged kernel reads each slot directly through a 1-entry table."""
    table = slots.to(torch.int32).reshape(-1, 1)
    return paged_prefill_attention(
        query,
        k_cache,
        v_cache,
        table,
        cu_query_lens,
        context_lens,
        scale,
        sliding_window,
        scales=scales,
        softcap=softcap,
    )


def contiguous_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    *,
    scales: KVScales | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """reference.contiguous_decode_attention (see contiguous_prefill_attention);
    split-KV as paged_decode_attention chooses it (a slot is max_seq_len long)."""
    table = slots.to(torch.int32).reshape(-1, 1)
    return paged_decode_attention(
        query,
        k_cache,
        v_cache,
        table,
        context_lens,
        scale,
        sliding_window,
        scales=scales,
        softcap=softcap,
    )
