// A batch's GEMM over GGUF weight rows decoded into fp32 and rounded to bf16, for bf16
// activations on a CPU with AVX512-BF16: y = x @ bf16(W).T where x has 16 rows or more.
// Included by quant_linear_cpu.cpp where the build has AVX512-BF16; panel_gemm_avx2.h's
// multiply drives it, as it drives the fp32 panels.
//
// Why: a batch's fp32 GEMM runs at the CPU's fp32 FMA rate, and vdpbf16ps multiplies
// twice the pairs per instruction; a GGUF served in bf16 at 32 streams reached 0.56x of
// the same model's bf16 checkpoint (bench/results/peers_gguf.md) with the fp32 panels.
// The values are the bf16 checkpoint's and the reference's (kernels/gguf_quant.py:
// dequantize, then `.to(x.dtype)`): each weight decoded exactly, then rounded to bf16
// (to nearest even, as torch rounds), every product exact and summed in fp32.
//
// Layout: a group of kCols = 32 output columns is packed as [K / 2][32][2] bf16: for each
// pair of k, the 32 columns' two weights side by side, so one vector holds 16 columns'
// pairs and one vdpbf16ps against a broadcast pair of x adds two products to each of
// 16 sums (no sums across lanes). A tile is kMR rows of x by the group's two vectors:
// 12 accumulators, two weight loads and one broadcast per row of x.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedserve_cpu {
namespace panel_bf16 {

// The 16 x 16 matrix of 32-bit elements in r[0..15] transposed in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // Each 128-bit lane L of r[4g + j] now holds rows 4g..4g+3 of column 4L + j.
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Gather the four lanes of each column: rows 0-7 from r[0..7], rows 8-15 from r[8..15].
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_i32x4(r[j], r[j + 4], 0x88);       // columns j (lanes 0, 2) ...
    t[j + 4] = _mm512_shuffle_i32x4(r[j], r[j + 4], 0xDD);   // ... and 4 + j (lanes 1, 3)
    t[j + 8] = _mm512_shuffle_i32x4(r[j + 8], r[j + 12], 0x88);
    t[j + 12] = _mm512_shuffle_i32x4(r[j + 8], r[j + 12], 0xDD);
  }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);      // column j
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);  // column 8 + j
  }
}

// The bf16 panels, as panel::multiply takes a kernel (panel_gemm_avx2.h).
struct Kernel {
  static constexpr int kCols = 32;  // output columns per packed group: two vectors of 16 sums
  static constexpr int kMR = 6;     // rows of x per tile: 12 accumulators, 2 weights, 1 broadcast
  using Packed = uint16_t;
  using X = uint16_t;

  // `rows` (<= kCols) decoded fp32 rows [rows][K] (K a multiple of 32) rounded to bf16 and
  // packed as [K / 2][kCols][2], the columns past `rows` zero. 32 values of k at a time:
  // each row's 32 become one vector of 16 pairs, and the two 16 x 16 blocks of pairs
  // (columns 0-15, 16-31) are transposed so that a pair of k holds every column's.
  static void pack(const float* w, int rows, int64_t K, uint16_t* out) {
    for (int64_t k = 0; k < K; k += 32) {
      __m512i half[2][16];
      for (int c = 0; c < kCols; ++c) {
        __m512i v = _mm512_setzero_si512();
        if (c < rows) {
          const float* src = w + c * K + k;
          v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        }
        half[c / 16][c % 16] = v;
      }
      for (int h = 0; h < 2; ++h) {
        transpose16(half[h]);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(out + (k / 2 + p) * 2 * kCols + h * 32, half[h][p]);
      }
    }
  }

  // out[r][0:kCols] = x[r] . the packed group's columns, for MR rows of bf16 x (ldx apart).
  template <int MR>
  static void tile(const uint16_t* packed, int64_t K, const uint16_t* x, int64_t ldx, float* out) {
    __m512 lo[MR], hi[MR];
    for (int r = 0; r < MR; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(packed + p * 2 * kCols);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(packed + p * 2 * kCols + 32);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        lo[r] = _mm512_dpbf16_ps(lo[r], w0, xb);
        hi[r] = _mm512_dpbf16_ps(hi[r], w1, xb);
      }
    }
    for (int r = 0; r < MR; ++r) {
      _mm512_storeu_ps(out + r * kCols, lo[r]);
      _mm512_storeu_ps(out + r * kCols + 16, hi[r]);
    }
  }
};

}  // namespace panel_bf16
}  // namespace pagedserve_cpu
