// A prefill's GEMM over weight rows already decoded into fp32: y = x @ W.T where x has
// many rows. Included by quant_linear_cpu.cpp where the build has AVX2 and FMA.
//
// The decoded rows are packed 16 output columns wide ([K][16] per group: two vectors),
// and a tile broadcasts one element of each of kMR rows of x against the two vectors:
// 12 accumulators, 2 weight loads and 6 broadcasts per 12 FMAs, and no sums across
// lanes. The dot-product tile (quant_fused_avx2.h's dense_tile: rows of x by rows of W,
// 7 vector loads per 12 FMAs and a horizontal sum per output) reached 51-57 GFLOP/s on
// one Zen 3 core where MKL's sgemm reaches 74; this shape is the one sgemm uses. Each
// output is its products summed in k order, one FMA each (the packed fp32 linear's
// order, linear_cpu.cpp).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagedserve_cpu {
namespace panel {

constexpr int kCols = 16;  // output columns per packed group: two AVX2 vectors
constexpr int kMR = 6;     // rows of x per tile: 12 accumulators, 2 weights, 1 broadcast (15 of 16 registers)

// `rows` (<= kCols) decoded rows [rows][K] packed as [K][kCols], the columns past `rows` zero.
inline void pack(const float* w, int rows, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k)
    for (int j = 0; j < kCols; ++j) out[k * kCols + j] = j < rows ? w[j * K + k] : 0.0f;
}

// out[r][0:kCols] = x[r] . the packed group's columns, for MR rows of x (K apart).
template <int MR>
inline void tile(const float* packed, int64_t K, const float* x, float* out) {
  __m256 lo[MR], hi[MR];
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(packed + k * kCols);
    const __m256 w1 = _mm256_loadu_ps(packed + k * kCols + 8);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * kCols, lo[r]);
    _mm256_storeu_ps(out + r * kCols + 8, hi[r]);
  }
}

// tile<rows> for a run-time count of rows, 1..kMR.
inline void tile_rows(int rows, const float* packed, int64_t K, const float* x, float* out) {
  switch (rows) {
    case 6: return tile<6>(packed, K, x, out);
    case 5: return tile<5>(packed, K, x, out);
    case 4: return tile<4>(packed, K, x, out);
    case 3: return tile<3>(packed, K, x, out);
    case 2: return tile<2>(packed, K, x, out);
    default: return tile<1>(packed, K, x, out);
  }
}

// One thread's scratch: a group's decoded rows and a panel's packed groups.
struct Buffers {
  std::vector<float> rows, packed;
  Buffers(int64_t groups, int64_t K)
      : rows(static_cast<size_t>(kCols * K)), packed(static_cast<size_t>(groups * kCols * K)) {}
};

// y[:, g_first * kCols : g_end * kCols] (up to N) for all M rows of x: the groups'
// rows decoded (decode(n0, rows, out): rows n0.. into [rows][K]) and packed once, then
// every kMR rows of x passed under the whole panel; put(m, n, value) stores an output.
template <typename Decode, typename Put>
void multiply(const float* xs, int64_t M, int64_t K, int64_t N, int64_t g_first, int64_t g_end, Buffers& buffers,
              const Decode& decode, const Put& put) {
  for (int64_t g = g_first; g < g_end; ++g) {
    const int64_t n0 = g * kCols;
    const int rows = static_cast<int>(std::min<int64_t>(kCols, N - n0));
    decode(n0, rows, buffers.rows.data());
    pack(buffers.rows.data(), rows, K, buffers.packed.data() + (g - g_first) * kCols * K);
  }
  float out[kMR * kCols];
  for (int64_t m = 0; m < M; m += kMR) {
    const int r = static_cast<int>(std::min<int64_t>(kMR, M - m));
    for (int64_t g = g_first; g < g_end; ++g) {
      tile_rows(r, buffers.packed.data() + (g - g_first) * kCols * K, K, xs + m * K, out);
      const int64_t n0 = g * kCols, cols = std::min<int64_t>(kCols, N - n0);
      for (int i = 0; i < r; ++i)
        for (int64_t j = 0; j < cols; ++j) put(m + i, n0 + j, out[i * kCols + j]);
    }
  }
}

}  // namespace panel
}  // namespace pagedserve_cpu
