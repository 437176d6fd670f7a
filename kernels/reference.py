"""Pure-torch reference ops over the paged KV cache.

These are the oracle the Triton and C++ kernels are tested against (and the
worker's `torch` backend). Beside the attention ops, the two fused element-wise
ops a decoder layer runs (issue 27, fault 9), each one kernel on the other
backends: ``add_rms_norm`` (the residual add and the next RMSNorm) and
``rope_write_kv`` (RoPE on query and key, then the K/V write), and a gated MLP's
activation where its projection does not fuse it (``gated_act``). Cache layout, per
layer:

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]

A token at position p of a sequence lives in block ``block_table[p // block_size]``
at offset ``p % block_size``; its *slot* is ``block * block_size + offset``.
Batches are varlen: sequence s owns the query rows
``cu_query_lens[s]:cu_query_lens[s + 1]``, which are the last tokens of its
``context_lens[s]`` tokens (the KV of the new tokens is written before attention).

Quantized caches (FP8 e4m3 / INT8, see kernels/quant.py): the cache tensors hold
the 8-bit values and every op takes the per-token-per-head scales as one
keyword, ``scales`` (a quant.KVScales), per layer

    k_scale, v_scale: [num_blocks, num_kv_heads, block_size]  fp32
    k_zero,  v_zero:  [num_blocks, num_kv_heads, block_size]  int8 (INT8 only)

write_kv quantizes each written token and stores its scales beside it; the
attention ops dequantize what they read (to fp32, then the query dtype). With
``scales`` left out (None) the ops are the unquantized ones, and a quantized
cache without them is refused.

The contiguous layout (the baseline the paged cache is measured against) gives
every sequence one whole slot of max_seq_len positions, per layer

    k_cache, v_cache: [max_batch, num_kv_heads, max_seq_len, head_dim]

(scales [max_batch, num_kv_heads, max_seq_len]). It is the paged layout with one
block of max_seq_len tokens per sequence, so write_kv and copy_blocks serve it
unchanged (slot = slot_index * max_seq_len + position); its attention ops,
contiguous_prefill_attention / contiguous_decode_attention, take each
sequence's slot index and read that slot's first context_len positions directly,
with no block-table gather.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels import quant
from kernels.quant import KVScales, checked_scales


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scales: KVScales | None = None,
) -> None:
    """Scatter key/value [T, kv_heads, head_dim] into the cache at slot_mapping [T];
    slots < 0 are skipped. A quantized cache (FP8/INT8) quantizes each token per
    KV head and writes its scale (and zero point) at the same slot."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    keep = slot_mapping >= 0
    if not bool(keep.all()):  # padding slots are rare: skip the masked copies when there are none
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    scales = checked_scales(k_cache, v_cache, scales)
    if scales is None:
        k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = value.to(v_cache.dtype)
        return
    for x, cache, (scale, zero) in zip((key, value), (k_cache, v_cache), scales.sides):
        q, s, z = quant.quantize(x, cache.dtype)
        cache[blocks, :, offsets] = q
        scale[blocks, :, offsets] = s
        if zero is not None and z is not None:
            zero[blocks, :, offsets] = z


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream's next value and its RMSNorm: summed = residual + x (x alone
    where residual is None, the first layer), both [T, hidden] in x's dtype; returns
    (rms_norm(summed) * weight in x's dtype, summed). The norm is computed in fp32
    (weight is fp32, with any family offset already in it, Gemma's 1 + w)."""
    summed = x if residual is None else residual + x
    normed = F.rms_norm(summed.float(), weight.shape, weight.float(), eps).to(x.dtype)
    return normed, summed


def activate(gate: Tensor, activation: str) -> Tensor:
    """A gated MLP's activation: silu, or gelu with the tanh approximation (Gemma)."""
    return F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")


def gated_act(y: Tensor, activation: str) -> Tensor:
    """act(gate) * up for y = [gate, up] ([T, 2 x intermediate]), in y's dtype."""
    gate, up = y.chunk(2, dim=-1)
    return activate(gate, activation) * up


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim] rotated by cos/sin [T, head_dim] (rotate-half convention:
    Llama, Qwen, Gemma checkpoints), in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_write_kv(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    scales: KVScales | None = None,
) -> tuple[Tensor, Tensor]:
    """RoPE on query [T, q_heads, d] and key [T, kv_heads, d] (apply_rope, cos/sin
    [T, d] in their dtype), then write_kv of the rotated key and value [T, kv_heads, d]
    at slot_mapping. Returns the rotated (query, key). Inputs may be strided views (the
    slices of one fused QKV projection)."""
    query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
    write_kv(key, value, k_cache, v_cache, slot_mapping, scales=scales)
    return query, key


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, kv_heads, bs, *rest] x [S, max_blocks] -> [S, kv_heads, max_blocks*bs, *rest]:
    K/V values (rest = head_dim) or their scales and zero points (no rest)."""
    num_seqs, max_blocks = block_tables.shape
    _, num_kv_heads, block_size, *rest = cache.shape
    # One index_select per KV head copies whole block rows straight into a
    # [kv_heads, S, context, ...] buffer: a single pass over the context (advanced
    # indexing plus a permute copied it twice, the largest cost of a CPU decode
    # step). The result is a [S, kv_heads, ...] view of that buffer.
    blocks = block_tables.flatten().long()
    gathered = cache.new_empty(num_kv_heads, num_seqs * max_blocks, block_size, *rest)
    for head in range(num_kv_heads):
        torch.index_select(cache[:, head], 0, blocks, out=gathered[head])
    return gathered.view(num_kv_heads, num_seqs, max_blocks * block_size, *rest).transpose(0, 1)


def _read_kv(
    read: Callable[[Tensor], Tensor], k_cache: Tensor, v_cache: Tensor, dtype: torch.dtype, scales: KVScales | None
) -> tuple[Tensor, Tensor]:
    """The sequences' K and V [S, kv_heads, K, d] in `dtype`, dequantized (through
    fp32) when the cache is quantized. `read` takes one layer's cache tensor (values,
    scales or zero points) to the sequences' [S, kv_heads, K, ...]: a block-table
    gather (paged) or a slot read (contiguous)."""
    scales = checked_scales(k_cache, v_cache, scales)
    if scales is None:
        return read(k_cache).to(dtype), read(v_cache).to(dtype)
    k, v = (
        quant.dequantize(read(cache), read(scale), None if zero is None else read(zero)).to(dtype)
        for cache, (scale, zero) in zip((k_cache, v_cache), scales.sides)
    )
    return k, v


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

    query [T, q_heads, d]; block_tables [S, max_blocks] (padding entries may be any
    valid block id); cu_query_lens [S + 1]; context_lens [S] (cached + new tokens).
    A token at position p sees positions j <= p, and with a sliding window W > 0
    only j > p - W. Returns [T, q_heads, d] in query's dtype. A quantized cache is
    read through its `scales`. softcap > 0 (Gemma 2's attn_logit_softcapping) caps
    the scaled scores, softcap * tanh(scores / softcap), before the mask and the
    softmax; 0 leaves them as they are.
    """
    tables = _used_blocks(block_tables, context_lens, k_cache.shape[2])
    keys, values = _read_kv(lambda t: gather_context(t, tables), k_cache, v_cache, query.dtype, scales)
    return _varlen_attention(query, keys, values, cu_query_lens, context_lens, scale, sliding_window, softcap)


def _used_blocks(block_tables: Tensor, context_lens: Tensor, block_size: int) -> Tensor:
    """The table columns some sequence's context reaches: padding columns are
    neither gathered nor attended over, so the result does not depend on how wide
    the tables are padded (a captured decode graph pads them to the longest
    sequence served). Reads the lengths on the host, as the contiguous ops do."""
    longest = int(context_lens.max()) if context_lens.numel() else 0
    return block_tables[:, : max(1, -(-longest // block_size))]


def _varlen_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    cu_query_lens: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
) -> Tensor:
    """Causal attention of varlen query rows over per-sequence K/V [S, kv_heads, K, d]
    whose position j is key j (K >= every context length; keys past a sequence's
    context are masked out). Shared by the paged and contiguous layouts."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = keys.shape[0]
    device = query.device
    query_lens = cu_query_lens[1:] - cu_query_lens[:-1]
    seq_of_token = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), query_lens.long(), output_size=num_tokens
    )
    row_of_token = torch.arange(num_tokens, device=device) - cu_query_lens[:-1].long()[seq_of_token]
    max_query_len = int(query_lens.max())

    # Pad the varlen batch to [S, heads, max_query_len, d]: one SDPA call, no per-sequence loop.
    padded = query.new_zeros(num_seqs, max_query_len, num_heads, head_dim)
    padded[seq_of_token, row_of_token] = query
    padded = padded.transpose(1, 2)

    key_pos = torch.arange(keys.shape[2], device=device)
    rows = torch.arange(max_query_len, device=device)
    query_pos = (context_lens - query_lens)[:, None].long() + rows[None, :]  # [S, Qmax]
    mask = key_pos[None, None, :] <= query_pos[:, :, None]
    if sliding_window > 0:
        mask &= key_pos[None, None, :] > query_pos[:, :, None] - sliding_window
    # Padding rows attend to key 0 so that softmax stays finite; they are dropped below.
    is_padding = rows[None, :] >= query_lens[:, None]
    mask |= is_padding[:, :, None] & (key_pos == 0)[None, None, :]

    out = _masked_attention(padded, keys, values, mask[:, None], scale, softcap)
    return out.transpose(1, 2)[seq_of_token, row_of_token]


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

    query [S, q_heads, d] -> [S, q_heads, d]."""
    tables = _used_blocks(block_tables, context_lens, k_cache.shape[2])
    keys, values = _read_kv(lambda t: gather_context(t, tables), k_cache, v_cache, query.dtype, scales)
    return _decode_attention(query, keys, values, context_lens, scale, sliding_window, softcap)


def _decode_attention(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
) -> Tensor:
    """The decode case of _varlen_attention (one query row per sequence, at
    position context_len - 1) without its padding: decode steps are most of a
    server's steps, and this runs once per layer."""
    key_pos = torch.arange(keys.shape[2], device=query.device)
    last = (context_lens.long() - 1)[:, None]
    mask = key_pos[None, :] <= last
    if sliding_window > 0:
        mask &= key_pos[None, :] > last - sliding_window
    return _masked_attention(query[:, :, None], keys, values, mask[:, None, None], scale, softcap)[:, :, 0]


def _masked_attention(
    query: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, softcap: float
) -> Tensor:
    """query [S, heads, Q, d] over keys/values [S, kv_heads, K, d] where `mask`
    (broadcast to [S, heads, Q, K]) allows. SDPA has no soft-cap, so a capped layer
    runs transformers' eager math instead (Gemma 2): scores in the query's dtype,
    scaled, capped, masked, softmax in fp32, rounded back to the query's dtype."""
    gqa = query.shape[1] != keys.shape[1]
    if not softcap:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, -torch.inf)
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), values)


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    scales: KVScales | None = None,
) -> None:
    """Copy whole blocks src[i] -> dst[i] in every layer; caches are [layers, blocks, ...].
    The scales and zero points of a quantized cache ([layers, blocks, ...] too) are
    copied with their blocks."""
    for tensor in (k_cache, v_cache, *(scales.tensors if scales is not None else ())):
        tensor[:, dst] = tensor[:, src]


def read_slots(cache: torch.Tensor, slots: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` positions of the given slots of a contiguous cache:
    [max_batch, kv_heads, max_seq_len, ...] x [S] -> [S, kv_heads, length, ...].
    Sliced before indexing, so only `length` positions per slot are copied."""
    return cache[:, :, :length][slots.long()]


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
    """paged_prefill_attention over the contiguous layout: sequence s owns slot
    slots[s] ([S] ints in [0, max_batch)) and its context is that slot's first
    context_lens[s] positions. Same query/varlen conventions, same result."""
    length = int(context_lens.max()) if context_lens.numel() else 0
    keys, values = _read_kv(lambda t: read_slots(t, slots, length), k_cache, v_cache, query.dtype, scales)
    return _varlen_attention(query, keys, values, cu_query_lens, context_lens, scale, sliding_window, softcap)


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
    """One query token per sequence over the contiguous layout. query [S, q_heads, d]."""
    length = int(context_lens.max()) if context_lens.numel() else 0
    keys, values = _read_kv(lambda t: read_slots(t, slots, length), k_cache, v_cache, query.dtype, scales)
    return _decode_attention(query, keys, values, context_lens, scale, sliding_window, softcap)


# --------------------------------------------------------------------------- sampling
#
# A temperature sample is a Gumbel race: argmax over tokens of logits / T + g, with
# g ~ Gumbel(0, 1). The noise of token t in a row is a pure function of the row's
# 32-bit key and t (a 32-bit hash), so a seeded row samples the same token on any
# device, whatever else is in the batch. kernels/triton/sampling.gumbel_argmax is the
# same op in one pass over the logits.

_M32 = 0xFFFFFFFF
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)  # lowbias32 (Wellons)


def _mul32_(x: Tensor, c: int) -> Tensor:
    """x *= c mod 2**32 for 0 <= x < 2**32, in 16-bit halves of c so no int64 product
    overflows (signed overflow is undefined in the C++ kernels, not merely wrapping).
    In place: a [B, vocab] int64 temporary per op made the hash 2-3x slower on CPU."""
    high = x * (c >> 16)
    high.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(high).bitwise_and_(_M32)


def hash32_(x: Tensor) -> Tensor:
    """lowbias32, in place, on int64 lanes holding 32-bit values: exact on every device."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, HASH_MULTIPLIERS[0])
    x.bitwise_xor_(x >> 15)
    _mul32_(x, HASH_MULTIPLIERS[1])
    return x.bitwise_xor_(x >> 16)


def gumbel(keys: Tensor, tokens: Tensor) -> Tensor:
    """Gumbel(0, 1) noise, float32, a pure function of (key, token); broadcasts."""
    bits = hash32_(keys ^ tokens).bitwise_right_shift_(9)
    # (23-bit integer + 0.5) * 2**-23 needs 24 significant bits: exact in float32, strictly in (0, 1).
    uniform = bits.float().add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_().log_().neg_()


# The noise lies in [-2.81, 16.64] (uniforms in [2**-24, 1 - 2**-24]); 21 leaves room for rounding.
NOISE_SPREAD = 21.0


def add_noise(scaled: Tensor, keys: Tensor, prune: bool) -> Tensor:
    """scaled [B, V] + every token's noise. Pruned: a token more than the noise's spread
    below its row's max cannot win the race, so it gets -inf instead of hashed noise:
    the same argmax, and on CPU, where hashing dominates, much less hashing when most
    tokens are out of reach."""
    if prune:
        can_win = scaled >= scaled.amax(dim=-1, keepdim=True) - NOISE_SPREAD
        if 4 * int(can_win.sum()) < can_win.numel():
            rows, tokens = can_win.nonzero(as_tuple=True)
            scores = torch.full_like(scaled, -torch.inf)
            scores[rows, tokens] = scaled[rows, tokens] + gumbel(keys[rows], tokens)
            return scores
    tokens = torch.arange(scaled.shape[-1], device=scaled.device)
    return scaled + gumbel(keys[:, None], tokens[None, :])


def gumbel_argmax(logits: Tensor, temperature: Tensor, keys: Tensor, thresholds: Tensor) -> Tensor:
    """The sampled token of each row: argmax over the tokens t with
    logits[t] / T >= threshold of logits[t] / T + gumbel(key, t), ties to the lowest id.

    logits [N, V] float32; temperature [N] float32 (> 0); keys [N] int64 holding
    32-bit values; thresholds [N] float32 on the scaled logits (top-k, top-p and
    min-p as one cut; -inf keeps every token). Returns [N] int64. On CPU the tokens
    out of the race's reach are not hashed (add_noise's pruning: same argmax)."""
    scaled = logits / temperature[:, None]
    scores = add_noise(scaled, keys, prune=logits.device.type == "cpu")
    return scores.masked_fill(scaled < thresholds[:, None], -torch.inf).argmax(dim=-1)


def argmax_logsumexp(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits [N, V] float32: the first index of the largest value (the greedy
    token) and the log-sum-exp (a token's logprob is its logit minus it)."""
    return logits.argmax(dim=-1), torch.logsumexp(logits, dim=-1)
