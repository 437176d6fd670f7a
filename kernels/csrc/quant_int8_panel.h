// The int8-activation product through panels (quant_int8_cpu.cpp) for the 32-weight
// formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): llama.cpp's repacked GEMM.
//
// A group of kLanes weight rows is repacked into a panel: per 32-block, the rows' fp16
// scales, then vectors whose lane n holds row n's quants 4g..4g+3 (repack: the layout).
// One dpbusd per 4 of x's quants (broadcast to every lane) then adds kLanes rows' partial
// dot products, and a block's kLanes integer sums are scaled with one convert and one
// FMA per row of x. quant_int8_avx2.h's tile pays the convert and the scale per (row of
// x, weight row) pair, 8 lanes' partials of one pair, and so is no faster than the fp32
// path at a batch's rows (bench/results/int8_panel.md: the panels' gain).
//
// A panel is the same bytes as the file's kLanes rows, permuted: the worker packs its
// weights so at load (pack_int8), and a weight kept in the file's layout (a tied head,
// whose rows the embedding reads) is repacked a group at a time per call.
//
// The unsigned operand: Q4's nibbles; Q5's nibbles with their fifth bits ORed in as they
// are loaded (weight_operand: a lane's 32 high bits spread to its bytes); Q8_0's quants +
// 128 with VNNI (the panel keeps them signed: one xor as they are loaded). A block's integer sum starts at -bias times the sum
// of x's quants over the block (bias 128 for Q8_0 with VNNI, 8 for Q4_0, 16 for Q5_0), so
// it ends as the exact dot product of the signed quants; Q4_1's and Q5_1's m multiplies
// x's scaled block sum (ds)
// in fp32, as the tile's affine terms do. Without VNNI the dot product is vpmaddubsw's,
// which saturates pairs past 32767, as Q8_0's 255 * 127 * 2 would: there Q8_0 multiplies
// |w| by x carrying w's sign (at most 2 * 128 * 127 = 32512), as the tiles do.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gguf_formats.h"
#include "quant_int8_avx2.h"
#include "weight_prefetch.h"

namespace pagedserve_cpu {
namespace int8_panel {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kLanes = 16;
constexpr bool kVnni = true;
using VI = __m512i;
using VF = __m512;
inline VI set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline VI dot(VI acc, VI u, VI s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline VI add_i(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VF to_f(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF set1_f(float v) { return _mm512_set1_ps(v); }
inline VF zero_f() { return _mm512_setzero_ps(); }
inline VF mul_f(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF fma_f(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_f(float* p, VF v) { _mm512_store_ps(p, v); }
// Bits 4g..4g+3 of each lane's 32 to bit 4 of its bytes 0..3: the multiply puts bit i at
// 8i + 4 (and the other copies where the mask drops them; no two sums carry).
inline VI fifth_bits(VI qh, int g) {
  const VI t = _mm512_and_si512(_mm512_srli_epi32(qh, 4 * g), _mm512_set1_epi32(0xF));
  return _mm512_and_si512(_mm512_mullo_epi32(t, _mm512_set1_epi32(0x02040810)), _mm512_set1_epi32(0x10101010));
}
inline VI or_i(VI a, VI b) { return _mm512_or_si512(a, b); }
// acc + the dot products of weight vectors w[0:n] with x's quants 4g..4g+3 (xq: vector g's).
inline VI dot_run(VI acc, const VI* w, const int8_t* xq, int n) {
  for (int g = 0; g < n; ++g) {
    int32_t four;
    std::memcpy(&four, xq + 4 * g, 4);
    acc = dot(acc, w[g], set1_i(four));
  }
  return acc;
}
#else
constexpr int kLanes = 8;
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif
using VI = __m256i;
using VF = __m256;
inline VI set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline VI dot(VI acc, VI u, VI s) { return _mm256_add_epi32(acc, qdot::dot_u8_s8(u, s)); }
inline VI add_i(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VF to_f(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF set1_f(float v) { return _mm256_set1_ps(v); }
inline VF zero_f() { return _mm256_setzero_ps(); }
inline VF mul_f(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fma_f(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_f(float* p, VF v) { _mm256_store_ps(p, v); }
inline VI fifth_bits(VI qh, int g) {  // as the AVX-512 one
  const VI t = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * g), _mm256_set1_epi32(0xF));
  return _mm256_and_si256(_mm256_mullo_epi32(t, _mm256_set1_epi32(0x02040810)), _mm256_set1_epi32(0x10101010));
}
inline VI or_i(VI a, VI b) { return _mm256_or_si256(a, b); }
// As the AVX-512 one, for unsigned operands of at most 5 bits and n <= 4. Without VNNI the
// products' pairs come as int16 (vpmaddubsw, at most 2 * 31 * 127 = 7874 each), and 4 of
// them add up in int16 with no overflow before one vpmaddwd widens the run: one multiply
// of 32 weights by 4 of x's quants where each group took two.
inline VI dot_run(VI acc, const VI* w, const int8_t* xq, int n) {
  __m256i pairs = _mm256_setzero_si256();
  for (int g = 0; g < n; ++g) {
    int32_t four;
    std::memcpy(&four, xq + 4 * g, 4);
    if constexpr (kVnni)
      acc = dot(acc, w[g], set1_i(four));
    else
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[g], set1_i(four)));
  }
  if constexpr (kVnni) return acc;
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif

// A panel block: the kLanes rows' fp16 scales (Q4_1, Q5_1: then their m; Q5: then their
// 32 high bits, lane n row n's), then the quants as vectors of kLanes 4-byte lanes: Q8_0's
// 8 (lane n of vector g: row n's quants 4g..4g+3), Q4's and Q5's 4 (lane n of vector j:
// row n's quant bytes 4j..4j+3, whose low nibbles are weights 4j..4j+3 and high ones
// 16 + 4j..). kLanes blocks of the file in as many bytes.
template <Format F>
constexpr int scales() {  // fp16 values per row and block: d, and m where the format has it
  return F == Format::kQ4_1 || F == Format::kQ5_1 ? 2 : 1;
}
template <Format F>
constexpr bool five_bit() {
  return F == Format::kQ5_0 || F == Format::kQ5_1;
}
template <Format F>
constexpr int64_t header_bytes() {
  return (2 * scales<F>() + (five_bit<F>() ? 4 : 0)) * kLanes;
}
template <Format F>
constexpr int64_t block_stride() {
  return static_cast<int64_t>(block_bytes<F>()) * kLanes;
}

// Rows n0 .. n0 + rows (rows <= kLanes) of the file's blocks repacked into `panel`
// (blocks * block_stride bytes); the lanes past `rows` get zero scales. Row by row: the
// group's rows are one run of memory, which the hardware prefetcher follows (the rows
// side by side, a block of each in turn, ran at half the speed), and each row asks for
// its share of the group kPrefetchTiles on (weight_prefetch.h): a row (~600 bytes) is
// too short for the prefetcher to ramp up.
template <Format F>
void repack(const uint8_t* data, int64_t row_bytes, int64_t blocks, int64_t n0, int rows, uint8_t* panel) {
  constexpr int kBytes = block_bytes<F>();
  constexpr int kScales = scales<F>();
  constexpr int kHigh = five_bit<F>() ? 4 : 0;  // Q5's high-bit bytes
  constexpr int kGroups = F == Format::kQ8_0 ? 8 : 4;
  for (int n = 0; n < kLanes; ++n) {
    const uint8_t* row = data + (n0 + n) * row_bytes;
    prefetch_ahead(data + n0 * row_bytes, kLanes * row_bytes, n, kLanes);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* p = panel + b * block_stride<F>();
      uint8_t* q = p + header_bytes<F>();
      if (n >= rows) {
        for (int s = 0; s < kScales; ++s) std::memset(p + (s * kLanes + n) * 2, 0, 2);
        if (kHigh) std::memset(p + 2 * kScales * kLanes + kHigh * n, 0, kHigh);
        for (int g = 0; g < kGroups; ++g) std::memset(q + g * 4 * kLanes + 4 * n, 0, 4);
        continue;
      }
      const uint8_t* blk = row + b * kBytes;
      for (int s = 0; s < kScales; ++s) std::memcpy(p + (s * kLanes + n) * 2, blk + 2 * s, 2);
      if (kHigh) std::memcpy(p + 2 * kScales * kLanes + kHigh * n, blk + 2 * kScales, kHigh);
      const uint8_t* qs = blk + 2 * kScales + kHigh;
      for (int g = 0; g < kGroups; ++g) std::memcpy(q + g * 4 * kLanes + 4 * n, qs + 4 * g, 4);
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
inline VF halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VI load_u(const uint8_t* p) { return _mm512_loadu_si512(p); }
// Q8_0's quants as dot's unsigned operand (+ 128, hence kQ8Bias), and their dot product.
constexpr int32_t kQ8Bias = 128;
inline VI q8_operand(VI w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline VI dot_q8(VI acc, VI w, VI x) { return dot(acc, w, x); }
inline VI low_nibbles(VI v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline VI high_nibbles(VI v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
#else
inline VF halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI load_u(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI low_nibbles(VI v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
// Q8_0's quants as dot's operand and their dot product: with VNNI + 128 (hence kQ8Bias);
// without, vpmaddubsw of |w| by x carrying w's sign (x's quants are within +-127, so no
// pair saturates).
constexpr int32_t kQ8Bias = kVnni ? 128 : 0;
inline VI q8_operand(VI w) {
  if constexpr (kVnni) return _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));
  return w;
}
inline VI dot_q8(VI acc, VI w, VI x) {
  if constexpr (kVnni) return dot(acc, w, x);
  return _mm256_add_epi32(acc, qdot::dot_u8_s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)));
}
inline VI high_nibbles(VI v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
#endif

template <Format F>
constexpr int32_t bias() {
  if constexpr (F == Format::kQ8_0) return kQ8Bias;
  return F == Format::kQ4_0 ? 8 : (F == Format::kQ5_0 ? 16 : 0);
}

// Vector g of a panel block (p) as dot's unsigned operand: Q8_0's quants 4g..4g+3 of every
// lane; Q4's and Q5's weights 4g..4g+3, the low nibbles of quant vector g (g < 4) or the
// high ones of vector g - 4, Q5's with their fifth bits.
template <Format F>
inline VI weight_operand(const uint8_t* p, int g) {
  const uint8_t* q = p + header_bytes<F>();
  if constexpr (F == Format::kQ8_0) return q8_operand(load_u(q + g * 4 * kLanes));
  const VI v = load_u(q + (g % 4) * 4 * kLanes);
  const VI nibbles = g < 4 ? low_nibbles(v) : high_nibbles(v);
  if constexpr (five_bit<F>()) return or_i(nibbles, fifth_bits(load_u(p + 2 * scales<F>() * kLanes), g));
  return nibbles;
}

// out[r][0:kLanes] = rows 0 .. MR of x times a panel's kLanes weight rows (a repacked
// group, or one packed at load: `streamed`, read from memory, the next groups prefetched).
// qx: x's quants (K apart), dx / ds: their block scales and scaled sums, s32: the sums of
// their quants per block (blocks apart each).
template <Format F, int MR>
void multiply(const uint8_t* panel, bool streamed, int64_t blocks, int64_t K, const int8_t* qx, const float* dx,
              const float* ds, const int32_t* s32, float* out) {
  VF acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = zero_f();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = panel + b * block_stride<F>();
    if (streamed) prefetch_ahead(panel, blocks * block_stride<F>(), b, blocks);
    VI w[8];
    for (int g = 0; g < 8; ++g) w[g] = weight_operand<F>(p, g);
    const VF dw = halves(p);
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = qx + r * K + b * 32;
      // Two chains of dpbusd, not one of 8: with few rows of x, a block's sum is
      // otherwise a chain of dependent instructions.
      VI sum[2] = {set1_i(-bias<F>() * s32[r * blocks + b]), set1_i(0)};
      if constexpr (F == Format::kQ8_0) {
        for (int g = 0; g < 8; ++g) {
          int32_t four;
          std::memcpy(&four, xq + 4 * g, 4);
          sum[g % 2] = dot_q8(sum[g % 2], w[g], set1_i(four));
        }
      } else {  // the nibbles (Q5: 5 bits) in two runs of 4 groups
        sum[0] = dot_run(sum[0], w, xq, 4);
        sum[1] = dot_run(sum[1], w + 4, xq + 16, 4);
      }
      acc[r] = fma_f(to_f(add_i(sum[0], sum[1])), mul_f(dw, set1_f(dx[r * blocks + b])), acc[r]);
      if constexpr (scales<F>() == 2) acc[r] = fma_f(halves(p + 2 * kLanes), set1_f(ds[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) store_f(out + r * kLanes, acc[r]);
}

}  // namespace int8_panel
}  // namespace pagedserve_cpu
