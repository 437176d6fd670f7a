// A batch's GEMM over weight rows already decoded into fp32: y = x @ W.T where x has 16
// rows or more (a prefill, a decode step of many streams). Included by
// quant_linear_cpu.cpp where the build has AVX2 and FMA.
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

// The 8 x 8 block of rows r[0..7] (each 8 floats) transposed in registers.
inline void transpose8(__m256 r[8]) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// The fp32 panels, as multiply() takes a kernel: a group's width (kCols), the rows of x
// a tile takes (kMR), what a packed weight and x hold, pack and tile<MR>
// (panel_gemm_bf16.h: bf16's).
struct Fp32 {
  static constexpr int kCols = 16;  // output columns per packed group: two AVX2 vectors
  static constexpr int kMR = 6;     // rows of x per tile: 12 accumulators, 2 weights, 1 broadcast (15 of 16 registers)
  using Packed = float;
  using X = float;

  // `rows` (<= kCols) decoded rows [rows][K] packed as [K][kCols], the columns past `rows`
  // zero. A whole group moves as 8 x 8 blocks transposed in registers: at a 32-row batch the
  // scalar copy cost a quarter of the multiply.
  static void pack(const float* w, int rows, int64_t K, float* out) {
    if (rows == kCols && K % 8 == 0) {
      for (int64_t k = 0; k < K; k += 8)
        for (int half = 0; half < 2; ++half) {
          __m256 r[8];
          for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(w + (half * 8 + j) * K + k);
          transpose8(r);
          for (int i = 0; i < 8; ++i) _mm256_storeu_ps(out + (k + i) * kCols + half * 8, r[i]);
        }
      return;
    }
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < kCols; ++j) out[k * kCols + j] = j < rows ? w[j * K + k] : 0.0f;
  }

  // out[r][0:kCols] = x[r] . the packed group's columns, for MR rows of x (ldx apart).
  template <int MR>
  static void tile(const float* packed, int64_t K, const float* x, int64_t ldx, float* out) {
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 w0 = _mm256_loadu_ps(packed + k * kCols);
      const __m256 w1 = _mm256_loadu_ps(packed + k * kCols + 8);
      for (int r = 0; r < MR; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm256_storeu_ps(out + r * kCols, lo[r]);
      _mm256_storeu_ps(out + r * kCols + 8, hi[r]);
    }
  }
};

// Kernel::tile<rows> for a run-time count of rows, 1..6.
template <typename Kernel>
inline void tile_rows(int rows, const typename Kernel::Packed* packed, int64_t K, const typename Kernel::X* x,
                      int64_t ldx, float* out) {
  static_assert(Kernel::kMR == 6, "tile_rows dispatches 1..6 rows");
  switch (rows) {
    case 6: return Kernel::template tile<6>(packed, K, x, ldx, out);
    case 5: return Kernel::template tile<5>(packed, K, x, ldx, out);
    case 4: return Kernel::template tile<4>(packed, K, x, ldx, out);
    case 3: return Kernel::template tile<3>(packed, K, x, ldx, out);
    case 2: return Kernel::template tile<2>(packed, K, x, ldx, out);
    default: return Kernel::template tile<1>(packed, K, x, ldx, out);
  }
}

// One thread's scratch: a group's decoded rows and a panel's packed groups.
template <typename Kernel>
struct Buffers {
  std::vector<float> rows;
  std::vector<typename Kernel::Packed> packed;
  Buffers(int64_t groups, int64_t K)
      : rows(static_cast<size_t>(Kernel::kCols * K)), packed(static_cast<size_t>(groups * Kernel::kCols * K)) {}
};

// y[:, g_first * kCols : g_end * kCols] (up to N) for all M rows of x (ldx apart): the
// groups' rows decoded (decode(n0, rows, out): rows n0.. into [rows][K] fp32) and packed
// once, then every kMR rows of x passed under the whole panel; put(m, n, value) stores
// an output.
template <typename Kernel, typename Decode, typename Put>
void multiply(const typename Kernel::X* x, int64_t ldx, int64_t M, int64_t K, int64_t N, int64_t g_first,
              int64_t g_end, Buffers<Kernel>& buffers, const Decode& decode, const Put& put) {
  constexpr int cols = Kernel::kCols;
  for (int64_t g = g_first; g < g_end; ++g) {
    const int64_t n0 = g * cols;
    const int rows = static_cast<int>(std::min<int64_t>(cols, N - n0));
    decode(n0, rows, buffers.rows.data());
    Kernel::pack(buffers.rows.data(), rows, K, buffers.packed.data() + (g - g_first) * cols * K);
  }
  float out[Kernel::kMR * cols];
  for (int64_t m = 0; m < M; m += Kernel::kMR) {
    const int r = static_cast<int>(std::min<int64_t>(Kernel::kMR, M - m));
    for (int64_t g = g_first; g < g_end; ++g) {
      tile_rows<Kernel>(r, buffers.packed.data() + (g - g_first) * cols * K, K, x + m * ldx, ldx, out);
      const int64_t n0 = g * cols, n_cols = std::min<int64_t>(cols, N - n0);
      for (int i = 0; i < r; ++i)
        for (int64_t j = 0; j < n_cols; ++j) put(m + i, n0 + j, out[i * cols + j]);
    }
  }
}

}  // namespace panel
}  // namespace pagedserve_cpu
