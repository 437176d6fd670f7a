// Software prefetch for the kernels that stream weight rows (the GGUF tiles and the
// quantized safetensors linears). On by default; the op weight_prefetch_enable(bool) ->
// bool (weight_prefetch.cpp) switches it for the process, for side-by-side measurement
// (bench/cpu/weight_stream.py).
#pragma once

#include <atomic>
#include <cstdint>

namespace pagedserve_cpu {

inline std::atomic<bool> g_weight_prefetch{true};

// A tile reads its NR weight rows side by side, a block of each per step: short
// interleaved streams that the hardware prefetcher follows poorly (a 30 MB GEMV from
// memory read ~5 GB/s on one AVX2 core where a plain sweep reads 16). The tiles after
// it are the next bytes in memory, so each of a tile's `steps` steps asks for its share
// of the tile kPrefetchTiles on: the cache lines that start in its share, so each line
// is asked for once (past the end of the weights: a hint, never a fault).
constexpr int64_t kPrefetchTiles = 2;
inline void prefetch_ahead(const uint8_t* tile, int64_t tile_bytes, int64_t step, int64_t steps) {
  if (!g_weight_prefetch.load(std::memory_order_relaxed)) return;
  const int64_t share = (tile_bytes + steps - 1) / steps;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(tile) + kPrefetchTiles * tile_bytes + step * share;
  for (uintptr_t line = (begin + 63) & ~uintptr_t{63}; line < begin + share; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(line), 0, 3);
}

}  // namespace pagedserve_cpu
