"""How an attention kernel is launched, as pure arithmetic: the tiles that fit a
GPU's shared memory at a head_dim (attention_tiles, attention_launch) and the
number of split-KV partitions of a decode (num_kv_splits)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import quant
from kernels.triton.common import INTERPRET, TL_DTYPES

# The most shared memory one block may use (the opt-in limit), by compute capability.
SHARED_MEMORY_PER_BLOCK = {
    (7, 5): 65536,
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
    (10, 0): 232448,
    (12, 0): 101376,
}
# Where no GPU says which (the interpreter): the tiles a Hopper part would run.
DEFAULT_CAPABILITY = (9, 0)


@dataclass(frozen=True, slots=True)
class AttentionTiles:
    block_m: int  # query rows ((token, query head) pairs) per program
    block_n: int  # KV positions per loop iteration
    num_warps: int
    num_stages: int  # software-pipelining depth of the KV loop


def attention_tiles(
    head_dim: int, group: int, decode: bool, capability: tuple[int, int], operand_bytes: int, quantized: bool
) -> AttentionTiles:
    """The tiles of paged_attention_kernel for a head_dim on an architecture.

    Registers bound them first: a thread holds BLOCK_N x BLOCK_D / (32 x warps)
    elements of each K/V tile with one 64-bit address each (the paged gather),
    and a prefill thread also BLOCK_M x BLOCK_D / (32 x warps) of the fp32
    accumulator; past ~48 elements ptxas spills (measured at head_dim 64/128/256
    on sm_80 and sm_90 with bench/kernel_resources.py; the 64 x 64 tiles used
    for every head_dim before spilled from head_dim 64 on). So wider heads get
    more warps and shorter KV tiles; fp32 operands and the dequantizing read
    (FP8/INT8: scales, conversions) take more registers, so half again. Then the
    architecture: before sm_80 (no asynchronous copies, 64 KB of shared memory)
    two pipeline stages, else three; the largest choice takes ~72 KB of shared
    memory, within sm_86/89's 99 KB. tests/unit/test_kernel_resources.py compiles
    the choices for sm_80, sm_86 and sm_90 and checks shared memory, registers and
    spills."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = operand_bytes >= 4
    if decode:
        # The group padded up to >= 16 rows, the smallest MMA tile (older Tritons
        # refuse smaller tl.dot operands outright).
        block_m = max(16, triton.next_power_of_2(group))
        num_warps = 4 if block_d <= 128 else 8
    else:  # at least the group: a program holds whole groups (BLOCK_Q tokens)
        # 16 rows at head_dim 256 for fp32 too: 32 x 16 spilled 4 bytes on sm_80 under
        # Triton 3.6 (bench/results/gpu_check.md).
        narrow = (quantized or wide) and block_d >= 256
        block_m = 64 if block_d <= 128 and not (wide or quantized) else 16 if narrow else 32
        block_m = max(block_m, triton.next_power_of_2(group))
        num_warps = 8
    block_n = 64 if block_d <= 64 else 32
    if wide or (quantized and (decode or block_d >= 256)):
        block_n //= 2
    num_stages = 3 if capability >= (8, 0) else 2
    return AttentionTiles(block_m, max(16, block_n), num_warps, num_stages)


_CAPABILITIES: dict[int, tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability (cached); DEFAULT_CAPABILITY elsewhere."""
    if device.type != "cuda":
        return DEFAULT_CAPABILITY
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def attention_launch(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    decode: bool,
    sliding: bool,
    capability: tuple[int, int] = DEFAULT_CAPABILITY,
    interpret: bool = INTERPRET,
    split: bool = False,
    min_split_tokens: int = 0,
    softcap: bool = False,
) -> tuple[dict[str, object], dict[str, int]]:
    """The compile-time parameters of paged_attention_kernel for one launch shape,
    and its launch options (warps, stages). `min_split_tokens` (split only): the
    shortest partition a sequence is cut into (0: exactly num_splits each)."""
    group = num_heads // num_kv_heads
    quantized = quant.quant_code(cache_dtype) > 0
    tiles = attention_tiles(head_dim, group, decode, capability, query_dtype.itemsize, quantized)
    # The matmuls run in the query dtype with fp32 accumulation (K/V are cast to it,
    # as the reference does); all fp32 under the interpreter, whose bf16 is broken.
    compute = tl.float32 if interpret else TL_DTYPES[query_dtype]
    constexprs = dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tiles.block_m,
        BLOCK_Q=tiles.block_m // group,  # a prefill program's tokens
        BLOCK_N=tiles.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DECODE=decode,
        SLIDING=sliding,
        SOFTCAP=softcap,
        COMPUTE=compute,
        DOT_PRECISION="ieee" if compute == tl.float32 else None,  # no TF32 for fp32 models
        QUANT=quant.quant_code(cache_dtype),
        SPLIT=split,
        MIN_SPLIT_TILES=-(-min_split_tokens // tiles.block_n) if split else 0,
    )
    return constexprs, {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}


# Split-KV (flash-decoding) heuristic. A decode program owns one (sequence, KV
# head) and streams that head's whole context; with fewer programs than SMs most
# of the GPU idles (1 sequence x 8 KV heads on a 132-SM H100 read a 32k context at
# ~5 % of the copy bandwidth). Splitting each context into P partitions makes
# P times as many programs, at the cost of a second (small) merge kernel.
PROGRAMS_PER_SM = 4  # programs in flight per SM that the split aims for (4 warps each)
MIN_SPLIT_TOKENS = 256  # a partition streams at least this many positions (4 KV tiles)
MAX_SPLITS = 64


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Partitions per sequence for a decode launch: as many as keep the programs
    within PROGRAMS_PER_SM per SM (so 1 once the (sequence, KV head) programs alone
    reach that), no partition shorter than MIN_SPLIT_TOKENS of max_context, at most
    MAX_SPLITS, rounded down to a power of two (one merge-kernel specialisation
    per power)."""
    programs = num_seqs * num_kv_heads
    if programs == 0:
        return 1
    wanted = min(PROGRAMS_PER_SM * num_sms // programs, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS)
    return 1 << (max(wanted, 1).bit_length() - 1)


_SM_COUNTS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere, which means no
    split (the interpreter runs programs one after another: splitting only adds work)."""
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
