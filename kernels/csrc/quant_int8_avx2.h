// Integer dot products of the 32-weight GGUF blocks (Q8_0, Q4_0, Q4_1) with activations
// quantized to int8 per 32-block (quant_int8_cpu.cpp), llama.cpp's Q8_0 x Q4_* scheme:
// one block of one weight row and one activation row is 32 byte products summed into 8
// int32 lanes (AVX2: vpmaddubsw into int16 pairs, then vpmaddwd by 1s; AVX-512 VNNI or
// AVX-VNNI: one vpdpbusd), converted to fp32 and accumulated with the product of the two
// scales. Included by quant_int8_cpu.cpp where the build has AVX2, FMA and F16C.
//
// vpmaddubsw multiplies unsigned bytes by signed ones, adding pairs into int16 with
// saturation; no pair here reaches it: the Q4 quants are nibbles (0-15: 2 * 15 * 127),
// and Q8_0's signed quants multiply as |w| (at most 128) by x carrying w's sign (x's
// quants are within +-127: 2 * 128 * 127 = 32512 < 32767). So the integer sums are exact.
//
// Q4_0's offset of 8 and Q4_1's m multiply the block's sum of x's quants, once per block
// and row pair (`affine_terms` in the .cpp): the vector path multiplies the nibbles as
// they are.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_formats.h"
#include "weight_prefetch.h"

namespace pagedserve_cpu {
namespace qdot {

inline __m256i ones16() { return _mm256_set1_epi16(1); }

// 8 int32 lanes, each the sum of 4 products of unsigned bytes u by signed bytes s.
inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones16());
#endif
}

// A block's 32 quants as bytes in weight order: Q4's nibbles unsigned (low nibbles are
// weights 0-15, high ones 16-31), Q8_0's signed.
template <Format F>
inline __m256i block_quants(const uint8_t* b) {
  if constexpr (F == Format::kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (F == Format::kQ4_1 ? 4 : 2)));
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
  }
}

inline float half(const uint8_t* p) {  // an fp16 scale, widened by F16C
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r][n] = sum over blocks of d_w[n] * d_x[r] * (q_w[n] . q_x[r]), for MR rows of x's
// quants (qx: K apart, dx: their scales, K / 32 apart) and NR rows of W (row_bytes
// apart). Each decoded weight block serves MR rows of x, each x block NR weight rows.
template <Format F, int MR, int NR>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t K, const int8_t* qx, const float* dx, float* out,
                 int64_t ldo) {
  constexpr int kBytes = block_bytes<F>();
  __m256 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) acc[r][n] = _mm256_setzero_ps();
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    prefetch_ahead(w, NR * row_bytes, b, blocks);
    __m256i wq[NR];
    __m256 dw[NR];
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * kBytes;
      wq[n] = block_quants<F>(blk);
      if constexpr (F == Format::kQ8_0) wq[n] = _mm256_sign_epi8(wq[n], wq[n]);  // |w|; x takes w's sign below
      dw[n] = _mm256_set1_ps(half(blk));
    }
    for (int r = 0; r < MR; ++r) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * K + b * 32));
      const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
      for (int n = 0; n < NR; ++n) {
        __m256i s = xq;
        if constexpr (F == Format::kQ8_0)
          s = _mm256_sign_epi8(xq, block_quants<F>(w + n * row_bytes + b * kBytes));
        const __m256 p = _mm256_cvtepi32_ps(dot_u8_s8(wq[n], s));
        acc[r][n] = _mm256_fmadd_ps(_mm256_mul_ps(dw[n], d), p, acc[r][n]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) out[r * ldo + n] = hsum8(acc[r][n]);
}

}  // namespace qdot
}  // namespace pagedserve_cpu
