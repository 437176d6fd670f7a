// The K-quants (Q4_K, Q5_K, Q6_K: llama.cpp's Q4_K_M preset is Q4_K with some Q6_K)
// multiplied as quant_fused_avx2.h multiplies the 32-weight blocks: a sub-block's quants
// go from the bytes into fp32 registers and into the products with x, its scale
// factored out of the sum. Q4_K / Q5_K, sub-blocks of 32 with w = (d * sc) * q - (dmin *
// mn): x . w = s * (x . q) - mn' * sum(x), s = d * sc and mn' = dmin * mn rounded as the
// reference rounds them; Q6_K, sub-blocks of 16 with w = (d * sc) * (q - 32): s * (x . (q
// - 32)). With x a unit vector the FMA by s rounds s * q once and the min's FNMADD
// subtracts once, as the reference does, so x = the identity returns its weights bit
// for bit.
//
// Layout (kernels/gguf_quant.py): Q4_K / Q5_K sub-block j's low 4 bits are the low
// (j even) or high (j odd) nibbles of qs[32 * (j / 2) ...][32], Q5_K's 5th bit is bit j
// of qh[0..32]. Q6_K's 256 weights are two halves of 128; run j (0-3) of 32 in a half
// takes the low (j < 2) or high nibbles of ql[64 * half + 32 * (j % 2) ...] and bits
// 2j, 2j + 1 of qh[32 * half ...], and holds sub-blocks 2 * (4 * half + j) and the next.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_formats.h"
#include "weight_prefetch.h"
#include "quant_fused_avx2.h"

namespace pagedserve_cpu {
namespace fused {

template <Format F>
constexpr bool k_format() {
  return F == Format::kQ4_K || F == Format::kQ5_K || F == Format::kQ6_K;
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Q4_K / Q5_K sub-block j's 32 quants (0-15 / 0-31).
template <Format F>
inline void sub_quants(const uint8_t* blk, int j, __m256 q[4]) {
  constexpr bool five = F == Format::kQ5_K;
  __m256i v = load32(blk + (five ? 48 : 16) + 32 * (j / 2));
  if (j % 2) v = _mm256_srli_epi16(v, 4);
  v = _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
  if constexpr (five) {  // bit j of each qh byte to bit 4: a 16-bit shift keeps bits 0-7 of each byte in it here
    const __m256i qh = load32(blk + 16);
    const __m256i hb = j <= 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
    v = _mm256_or_si256(v, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
  }
  widen32<false>(v, q);
}

// Q6_K run j (0-3) of half h: 32 quants, 32 taken off (-32..31).
inline void q6_quants(const uint8_t* blk, int h, int j, __m256 q[4]) {
  __m256i lo = load32(blk + 64 * h + 32 * (j % 2));
  if (j >= 2) lo = _mm256_srli_epi16(lo, 4);
  lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0F));
  const __m256i qh = load32(blk + 128 + 32 * h);
  // bits 2j, 2j + 1 of each byte to bits 4, 5 (as above, a 16-bit shift of at most 4 keeps them in the byte)
  const __m256i hb = j <= 1 ? _mm256_slli_epi16(qh, 4 - 2 * j) : _mm256_srli_epi16(qh, 2 * j - 4);
  const __m256i v = _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
  widen32<true>(_mm256_sub_epi8(v, _mm256_set1_epi8(32)), q);
}

// A Q4_K / Q5_K block's 8 sub-block scales d * sc and mins dmin * mn, each product
// rounded once in fp32 as the reference's. The 6-bit fields come out of the 12 bytes
// as llama.cpp unpacks them (k_scale_min's fields, four at a time in 32-bit words:
// bytes 0-7 the scales, 8-15 the mins), then one vector multiply each.
inline void k_scales(const uint8_t* blk, float s[8], float mn[8]) {
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  uint32_t u[4];
  std::memcpy(u, blk + 4, 12);
  u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
  const uint32_t mins_low = u[1] & low6;
  u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
  u[2] = mins_low;
  u[0] &= low6;
  const __m128i fields = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_set1_ps(f16(blk)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields))));
  _mm256_storeu_ps(mn, _mm256_mul_ps(_mm256_set1_ps(f16(blk + 2)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)))));
}

// Q6_K's 16 sub-block scales d * sc.
inline void q6_scales(const uint8_t* blk, float s[16]) {
  const __m256 d = _mm256_set1_ps(f16(blk + 208));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192));
  _mm256_storeu_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  _mm256_storeu_ps(s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
}

// f(e, q, s, mn) for each run of 32 weights of a block, in order: e its first weight, q
// its quants, s its scales (Q4_K / Q5_K: s[0] for the run; Q6_K: s[0] for its first 16
// weights, s[1] for the next), mn its min (Q4_K / Q5_K: mn[0]; Q6_K: none, nullptr).
template <Format F, typename Fn>
inline void for_each_run(const uint8_t* blk, Fn&& f) {
  __m256 q[4];
  if constexpr (F == Format::kQ6_K) {
    float s[16];
    q6_scales(blk, s);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) {
        const int e = 128 * h + 32 * j;
        q6_quants(blk, h, j, q);
        f(e, q, s + e / 16, static_cast<const float*>(nullptr));
      }
  } else {
    float s[8], mn[8];
    k_scales(blk, s, mn);
    for (int j = 0; j < 8; ++j) {
      sub_quants<F>(blk, j, q);
      f(32 * j, q, s + j, static_cast<const float*>(mn + j));
    }
  }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// `rows` rows of W decoded into fp32, out [rows][K], the reference's s * q (- mn), each
// operation rounded once (contraction off: an FMA would round once).
template <Format F>
inline void decode_rows_k(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, float* out) {
  for (int n = 0; n < rows; ++n)
    for (int64_t b = 0; b < K / 256; ++b) {
      float* o = out + n * K + b * 256;
      for_each_run<F>(w + n * row_bytes + b * block_bytes<F>(),
                      [&](int e, const __m256* q, const float* s, const float* mn) {
                        for (int i = 0; i < 4; ++i) {
                          __m256 v;
                          if constexpr (F == Format::kQ6_K)
                            v = _mm256_mul_ps(_mm256_set1_ps(s[i / 2]), q[i]);
                          else
                            v = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(s[0]), q[i]), _mm256_set1_ps(mn[0]));
                          _mm256_storeu_ps(o + e + 8 * i, v);
                        }
                      });
    }
}
#pragma GCC pop_options

// out[r][n] = x[r] . W[n] for MR rows of x (K apart) and NR rows of W (row_bytes apart);
// xs: block_sums of x (Q4_K / Q5_K's min term).
template <Format F, int MR, int NR>
inline void tile_k(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xs, float* out,
                   int64_t ldo) {
  Accumulators<MR, NR> acc;
  for (int64_t b = 0; b < K / 256; ++b) {
    prefetch_ahead(w, NR * row_bytes, b, K / 256);
    for (int n = 0; n < NR; ++n)
      for_each_run<F>(w + n * row_bytes + b * block_bytes<F>(),
                      [&](int e, const __m256* q, const float* s, const float* mn) {
                        for (int r = 0; r < MR; ++r) {
                          const float* xr = x + r * K + b * 256 + e;
                          __m256& a = acc.v[r][n];
                          if constexpr (F == Format::kQ6_K) {  // two sub-blocks of 16
                            const __m256 t0 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1],
                                                              _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]));
                            const __m256 t1 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3],
                                                              _mm256_mul_ps(_mm256_loadu_ps(xr + 16), q[2]));
                            a = _mm256_fmadd_ps(_mm256_set1_ps(s[1]), t1, _mm256_fmadd_ps(_mm256_set1_ps(s[0]), t0, a));
                          } else {
                            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1], t);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q[2], t);
                            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3], t);
                            a = _mm256_fnmadd_ps(_mm256_set1_ps(mn[0]),
                                                 _mm256_loadu_ps(xs + r * (K / 4) + (b * 256 + e) / 4),
                                                 _mm256_fmadd_ps(_mm256_set1_ps(s[0]), t, a));
                          }
                        }
                      });
  }
  acc.sums(out, ldo);
}

// The format's tile and decode, whichever header holds them.
template <Format F, int MR, int NR>
inline void tile(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xs, float* out,
                 int64_t ldo) {
  if constexpr (k_format<F>())
    tile_k<F, MR, NR>(w, row_bytes, K, x, xs, out, ldo);
  else
    tile32<F, MR, NR>(w, row_bytes, K, x, xs, out, ldo);
}

template <Format F>
inline void decode_rows(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, float* out) {
  if constexpr (k_format<F>())
    decode_rows_k<F>(w, row_bytes, rows, K, out);
  else
    decode_rows32<F>(w, row_bytes, rows, K, out);
}

template <Format F>
constexpr bool needs_sums() {
  return affine<F>() || F == Format::kQ4_K || F == Format::kQ5_K;
}

}  // namespace fused
}  // namespace pagedserve_cpu
