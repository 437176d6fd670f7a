// The 32-weight GGUF blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) multiplied without ever
// writing the decoded weights out: each block's quants go from its bytes into fp32
// registers and straight into the products with x. Included by quant_linear_cpu.cpp
// where the build has AVX2, FMA and F16C (any x86 CPU with AVX-512 has them too: the
// same 256-bit code runs there). The K-quants' tiles are quant_kquant_avx2.h's.
//
// The block's scale factors out of its sum: x . (d * q + m) = d * (x . q) + m * sum(x),
// so a block costs, per row of x, four FMAs of x by the integer quants (exact products
// of fp32 by small integers, summed in fp32), one FMA by d and, for Q4_1 / Q5_1, one by
// m against sum(x) over the block, precomputed once per row of x (lane-wise, as eight
// partial sums). Where x is a unit vector this rounds exactly as the reference's decode
// does (d * q rounded once, then + m rounded once), so x = the identity still returns
// the reference's weights bit for bit; otherwise the result is the reference's within
// fp32 rounding, as before. Against decoding into an fp32 buffer first, this saves the
// per-weight multiply, add, store and reload: what bounded the step (the weights' bytes
// are a sixth of fp32's, their decode was not).
//
// A tile is kMR rows of x by kNR output rows, kMR * kNR independent accumulator chains
// (the two FMAs a block adds to one chain depend on each other: one row alone would
// wait on their latency).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_formats.h"
#include "weight_prefetch.h"

namespace pagedserve_cpu {
namespace fused {

template <Format F>
constexpr bool affine() {  // d * q + m: the tile adds m * sum(x) per block
  return F == Format::kQ4_1 || F == Format::kQ5_1;
}

inline __m256 f16_splat(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(bits));
}

// 16 bytes -> two vectors of 8 fp32 lanes (bytes 0-7, 8-15), as signed or unsigned integers.
template <bool Signed>
inline void widen16(__m128i b, __m256 q[2]) {
  const __m128i part[2] = {b, _mm_srli_si128(b, 8)};
  for (int i = 0; i < 2; ++i)
    q[i] = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(part[i]) : _mm256_cvtepu8_epi32(part[i]));
}

// 32 bytes -> four vectors of 8 fp32 lanes (bytes 0-7, 8-15, 16-23, 24-31).
template <bool Signed>
inline void widen32(__m256i v, __m256 q[4]) {
  widen16<Signed>(_mm256_castsi256_si128(v), q);
  widen16<Signed>(_mm256_extracti128_si256(v, 1), q + 2);
}

// Byte i = 0xFF where bit i of `bits` is set, else 0 (llama.cpp's bytes_from_bits_32):
// byte i takes byte i / 8 of the word, ORed with every bit but i % 8.
inline __m256i bytes_from_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

// The block's 32 quants as four vectors of 8 fp32 lanes: weights 0-7, 8-15, 16-23, 24-31
// (Q4 / Q5: the low nibbles are weights 0-15, the high ones 16-31; Q5's 5th bit j of
// qh is weight j's; Q4_0 / Q5_0's offset taken off as bytes, before the widening).
template <Format F>
inline void quants(const uint8_t* b, __m256 q[4]) {
  if constexpr (F == Format::kQ8_0) {
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i))));
  } else {
    constexpr bool five = F == Format::kQ5_0 || F == Format::kQ5_1;
    constexpr int offset = affine<F>() ? 0 : (five ? 16 : 8);
    const uint8_t* qs = b + (affine<F>() ? 4 : 2) + (five ? 4 : 0);
    if constexpr (five) {  // the nibbles and the 5th bits as 32 bytes (16-byte halves: 10% slower here)
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      uint32_t qh;
      std::memcpy(&qh, qs - 4, 4);
      __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
      v = _mm256_or_si256(v, _mm256_and_si256(bytes_from_bits(qh), _mm256_set1_epi8(0x10)));
      if constexpr (offset != 0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(offset));
      widen32<offset != 0>(v, q);
    } else {  // 8 bytes widened to int32 lanes as they load, then split: low nibbles are
              // weights i..i+7, high ones i+16..i+23 (fewer shuffles than splitting first)
      const __m256i mask = _mm256_set1_epi32(0x0F);
      for (int half = 0; half < 2; ++half) {
        const __m256i b32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * half)));
        __m256i lo = _mm256_and_si256(b32, mask), hi = _mm256_srli_epi32(b32, 4);
        if constexpr (offset != 0) {
          lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(offset));
          hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(offset));
        }
        q[half] = _mm256_cvtepi32_ps(lo);
        q[half + 2] = _mm256_cvtepi32_ps(hi);
      }
    }
  }
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A tile's MR x NR accumulators, zeroed; sums() writes each one's lanes' sum to out[r][n].
template <int MR, int NR>
struct Accumulators {
  __m256 v[MR][NR];
  Accumulators() {
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NR; ++n) v[r][n] = _mm256_setzero_ps();
  }
  void sums(float* out, int64_t ldo) const {
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NR; ++n) out[r * ldo + n] = hsum8(v[r][n]);
  }
};

// Eight lane-wise partial sums of each 32-element block of x's rows, xs [M][K / 4]: the
// m * sum(x) term of Q4_1 / Q5_1 and the min term of Q4_K / Q5_K.
inline void block_sums(const float* x, int64_t M, int64_t K, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* p = x + m * K + b * 32;
      const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)),
                                     _mm256_add_ps(_mm256_loadu_ps(p + 16), _mm256_loadu_ps(p + 24)));
      _mm256_storeu_ps(xs + m * (K / 4) + b * 8, s);
    }
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// `rows` rows of W decoded into fp32, out [rows][K]: the reference's d * q (+ m), the
// product and the sum each rounded once (contraction off: an FMA would round once).
template <Format F>
inline void decode_rows32(const uint8_t* w, int64_t row_bytes, int rows, int64_t K, float* out) {
  for (int n = 0; n < rows; ++n)
    for (int64_t b = 0; b < K / 32; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * block_bytes<F>();
      __m256 q[4];
      quants<F>(blk, q);
      const __m256 d = f16_splat(blk);
      for (int i = 0; i < 4; ++i) {
        __m256 v = _mm256_mul_ps(d, q[i]);
        if constexpr (affine<F>()) v = _mm256_add_ps(v, f16_splat(blk + 2));
        _mm256_storeu_ps(out + n * K + b * 32 + i * 8, v);
      }
    }
}
#pragma GCC pop_options

// out[r][n] = x[r] . w[n] for MR rows of x and NR decoded rows of W, both K apart: each
// x load feeds NR FMAs, each w load MR (a batch's GEMM: the decode above is paid once
// per weight row for all the rows of x).
template <int MR, int NR>
inline void dense_tile(const float* w, int64_t K, const float* x, float* out, int64_t ldo) {
  Accumulators<MR, NR> acc;
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int r = 0; r < MR; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int n = 0; n < NR; ++n) acc.v[r][n] = _mm256_fmadd_ps(xv, wv[n], acc.v[r][n]);
    }
  }
  acc.sums(out, ldo);
}

// out[r][n] = x[r] . W[n] for MR rows of x (K apart) and NR rows of W (row_bytes apart).
template <Format F, int MR, int NR>
inline void tile32(const uint8_t* w, int64_t row_bytes, int64_t K, const float* x, const float* xs, float* out,
                   int64_t ldo) {
  Accumulators<MR, NR> acc;
  for (int64_t b = 0; b < K / 32; ++b) {
    prefetch_ahead(w, NR * row_bytes, b, K / 32);
    for (int n = 0; n < NR; ++n) {
      const uint8_t* blk = w + n * row_bytes + b * block_bytes<F>();
      __m256 q[4];
      quants<F>(blk, q);
      const __m256 d = f16_splat(blk);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * K + b * 32;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1], t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q[2], t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3], t);
        acc.v[r][n] = _mm256_fmadd_ps(d, t, acc.v[r][n]);
        if constexpr (affine<F>())
          acc.v[r][n] = _mm256_fmadd_ps(f16_splat(blk + 2), _mm256_loadu_ps(xs + r * (K / 4) + b * 8), acc.v[r][n]);
      }
    }
  }
  acc.sums(out, ldo);
}

}  // namespace fused
}  // namespace pagedserve_cpu
