// The int8-activation product through panels (quant_int8_cpu.cpp) for the 32-weight
// formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and the K-quants: llama.cpp's repacked GEMM.
//
// A group of kLanes weight rows is repacked into a panel: per block, the rows' fp16
// scales, then vectors whose lane n holds row n's quant bytes 4v..4v+3 (repack: the layout).
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
// are loaded (weight_operand: a lane's 32 high bits spread to its bytes); the K-quants'
// likewise; Q8_0's quants + 128 with VNNI (the panel keeps them signed: one xor as they
// are loaded). A block's integer sum starts at -bias times the sum of x's quants over the
// block (bias 128 for Q8_0 with VNNI, 8 for Q4_0, 16 for Q5_0, 32 per 16 for Q6_K), so it
// ends as the exact dot product of the signed quants; the m of Q4_1 and Q5_1 (and the
// K-quants' -dmin * m) multiplies x's scaled block sum (ds) in fp32, as the tile's affine
// terms do. Without VNNI the dot product is vpmaddubsw's,
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
inline VI or_i(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI mul_i(VI v, int32_t m) { return _mm512_mullo_epi32(v, _mm512_set1_epi32(m)); }
inline VI shr_i(VI v, int n) { return _mm512_srli_epi32(v, n); }
inline VI shl_i(VI v, int n) { return _mm512_slli_epi32(v, n); }
inline VI mask_i(VI v, int32_t m) { return _mm512_and_si512(v, _mm512_set1_epi32(m)); }
inline VI byte_i(VI v, int k) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * k), 24); }  // signed
// Each byte's bits s.. under `mask` moved to bit 4 (Q5_K's and Q6_K's high bits over their
// nibbles).
inline VI bits_to4(VI v, int s, char mask) {
  return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(v, s), _mm512_set1_epi8(mask)), 4);
}
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
inline VI or_i(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI mul_i(VI v, int32_t m) { return _mm256_mullo_epi32(v, _mm256_set1_epi32(m)); }
inline VI shr_i(VI v, int n) { return _mm256_srli_epi32(v, n); }
inline VI shl_i(VI v, int n) { return _mm256_slli_epi32(v, n); }
inline VI mask_i(VI v, int32_t m) { return _mm256_and_si256(v, _mm256_set1_epi32(m)); }
inline VI byte_i(VI v, int k) { return _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * k), 24); }
inline VI bits_to4(VI v, int s, char mask) {
  return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(v, s), _mm256_set1_epi8(mask)), 4);
}
// As the AVX-512 one, for unsigned operands of at most 5 bits and n <= 4 (6 bits: n <= 2).
// Without VNNI the products' pairs come as int16 (vpmaddubsw, at most 2 * 31 * 127 = 7874
// each), and 4 of them add up in int16 with no overflow before one vpmaddwd widens the
// run: one multiply of 32 weights by 4 of x's quants where each group took two.
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

// Bits 4g..4g+3 of each lane's 32 to bit 4 of its bytes 0..3: the multiply puts bit i at
// 8i + 4 (and the other copies where the mask drops them; no two sums carry).
inline VI fifth_bits(VI qh, int g) { return mask_i(mul_i(mask_i(shr_i(qh, 4 * g), 0xF), 0x02040810), 0x10101010); }

// A panel block (a block of each of kLanes rows): the rows' fp16 values that open the
// block (d; Q4_1, Q5_1: then m; Q4_K: d then dmin), then the rest of each row's block as
// vectors of kLanes 4-byte lanes, lane n of vector v holding row n's bytes 4v..4v+3 of
// that rest: Q8_0's quants (8 vectors: quants 4v..4v+3), Q4's nibbles (4: low nibbles
// weights 4v..4v+3, high ones 16 + 4v..), Q5's high bits (1) then its nibbles (4), Q4_K's
// 6-bit scales and mins (3) then its nibbles (32: vector 3 + 8k + g, weights 4g..4g+3 of
// sub-block 2k in the low nibbles, of 2k + 1 in the high ones); Q5_K's the same with its
// high bits (8: vector 3 + g, bit j of a byte sub-block j's) before the nibbles (vector
// 11 + 8k + g). Q6_K's d closes its
// block: the panel block opens with it, and the vectors are the bytes before it (ql:
// 32, qh: 16, the int8 scales: 4). kLanes blocks of the file in as many bytes.
template <Format F>
constexpr int scales() {
  return F == Format::kQ4_1 || F == Format::kQ5_1 || F == Format::kQ4_K || F == Format::kQ5_K ? 2 : 1;
}
template <Format F>
constexpr int lane_vectors() {
  return (block_bytes<F>() - 2 * scales<F>()) / 4;
}
template <Format F>
constexpr int scales_at() {  // in a file block: where its fp16 values are, and the rest
  return F == Format::kQ6_K ? block_bytes<F>() - 2 : 0;
}
template <Format F>
constexpr int rest_at() {
  return F == Format::kQ6_K ? 0 : 2 * scales<F>();
}
template <Format F>
constexpr bool five_bit() {
  return F == Format::kQ5_0 || F == Format::kQ5_1;
}
template <Format F>
constexpr int64_t block_stride() {
  return static_cast<int64_t>(block_bytes<F>()) * kLanes;
}
template <Format F>
inline const uint8_t* lane_vector(const uint8_t* p, int v) {
  return p + (2 * scales<F>() + 4 * v) * kLanes;
}

// Rows n0 .. n0 + rows (rows <= kLanes) of the file's blocks repacked into `panel`
// (blocks * block_stride bytes); the lanes past `rows` are zeros. Row by row: the
// group's rows are one run of memory, which the hardware prefetcher follows (the rows
// side by side, a block of each in turn, ran at half the speed), and each row asks for
// its share of the group kPrefetchTiles on (weight_prefetch.h): a row (~600 bytes) is
// too short for the prefetcher to ramp up.
template <Format F>
void repack(const uint8_t* data, int64_t row_bytes, int64_t blocks, int64_t n0, int rows, uint8_t* panel) {
  constexpr int kBytes = block_bytes<F>();
  constexpr int kScales = scales<F>();
  for (int n = 0; n < kLanes; ++n) {
    const uint8_t* row = data + (n0 + n) * row_bytes;
    prefetch_ahead(data + n0 * row_bytes, kLanes * row_bytes, n, kLanes);
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* p = panel + b * block_stride<F>();
      const uint8_t* blk = row + b * kBytes;
      for (int s = 0; s < kScales; ++s) {
        uint8_t* to = p + (s * kLanes + n) * 2;
        n < rows ? std::memcpy(to, blk + scales_at<F>() + 2 * s, 2) : std::memset(to, 0, 2);
      }
      for (int v = 0; v < lane_vectors<F>(); ++v) {
        uint8_t* to = const_cast<uint8_t*>(lane_vector<F>(p, v)) + 4 * n;
        n < rows ? std::memcpy(to, blk + rest_at<F>() + 4 * v, 4) : std::memset(to, 0, 4);
      }
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

// Vector g of a 32-weight format's panel block (p) as dot's unsigned operand: Q8_0's
// quants 4g..4g+3 of every lane; Q4's and Q5's weights 4g..4g+3, the low nibbles of
// nibble vector g (g < 4) or the high ones of vector g - 4, Q5's with their fifth bits.
template <Format F>
inline VI weight_operand(const uint8_t* p, int g) {
  if constexpr (F == Format::kQ8_0) return q8_operand(load_u(lane_vector<F>(p, g)));
  constexpr int first = five_bit<F>() ? 1 : 0;  // Q5's nibbles follow its high bits
  const VI v = load_u(lane_vector<F>(p, first + g % 4));
  const VI nibbles = g < 4 ? low_nibbles(v) : high_nibbles(v);
  if constexpr (five_bit<F>()) return or_i(nibbles, fifth_bits(load_u(lane_vector<F>(p, 0)), g));
  return nibbles;
}

// A Q4_K or Q5_K panel block's 8 sub-blocks' scales (d * sc) and negated mins (-dmin * m)
// per lane, unpacked from the 12 bytes of 6-bit values as gguf's get_scale_min_k4 does.
template <Format F>
inline void k_scales(const uint8_t* p, VF* dsc, VF* dmn) {
  const VF d = halves(p), neg_dmin = mul_f(halves(p + 2 * kLanes), set1_f(-1.0f));
  const VI s0 = load_u(lane_vector<F>(p, 0)), s1 = load_u(lane_vector<F>(p, 1)), s2 = load_u(lane_vector<F>(p, 2));
  for (int j = 0; j < 8; ++j) {
    const int i = 8 * (j % 4);  // the lanes' byte j % 4 of each of s0, s1, s2
    VI sc, mn;
    if (j < 4) {
      sc = mask_i(shr_i(s0, i), 63);
      mn = mask_i(shr_i(s1, i), 63);
    } else {
      sc = or_i(mask_i(shr_i(s2, i), 0xF), shl_i(mask_i(shr_i(s0, i + 6), 3), 4));
      mn = or_i(mask_i(shr_i(s2, i + 4), 0xF), shl_i(mask_i(shr_i(s1, i + 6), 3), 4));
    }
    dsc[j] = mul_f(d, to_f(sc));
    dmn[j] = mul_f(neg_dmin, to_f(mn));
  }
}

// acc[r] += over x's 32-block b (weights 128h + 32j ..) of rows 0 .. MR of x, the two
// 16-weight halves' d * sc * (w - 32) . x's quants (dsa, dsb: d * sc of each; sum16: the
// sums of x's quants per 16, K / 16 apart).
template <int MR>
inline void add_q6_block(VF* acc, const VI* w, VF dsa, VF dsb, int64_t b, int64_t blocks, int64_t K,
                         const int8_t* qx, const float* dx, const int32_t* sum16) {
  for (int r = 0; r < MR; ++r) {
    const int8_t* xq = qx + r * K + b * 32;
    const int32_t* s16 = sum16 + r * 2 * blocks + 2 * b;
    VI half[2];
    for (int i = 0; i < 2; ++i) {  // 6-bit operands: runs of 2 groups
      half[i] = dot_run(set1_i(-32 * s16[i]), w + 4 * i, xq + 16 * i, 2);
      half[i] = dot_run(half[i], w + 4 * i + 2, xq + 16 * i + 8, 2);
    }
    const VF d = set1_f(dx[r * blocks + b]);
    acc[r] = fma_f(to_f(half[0]), mul_f(dsa, d), acc[r]);
    acc[r] = fma_f(to_f(half[1]), mul_f(dsb, d), acc[r]);
  }
}

// acc[r] += dw * x's scale * (w . x's quants) (+ mw * x's scaled sum where the format has
// an offset) over 32-block b of rows 0 .. MR of x (as multiply's arguments).
template <Format F, int MR>
inline void add_block(VF* acc, const VI* w, VF dw, VF mw, int64_t b, int64_t blocks, int64_t K, const int8_t* qx,
                      const float* dx, const float* ds, const int32_t* s32) {
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
    if constexpr (scales<F>() == 2) acc[r] = fma_f(mw, set1_f(ds[r * blocks + b]), acc[r]);
  }
}

// out[r][0:kLanes] = rows 0 .. MR of x times a panel's kLanes weight rows (a repacked
// group, or one packed at load: `streamed`, read from memory, the next groups prefetched).
// qx: x's quants (K apart), dx / ds: their block scales and scaled sums, s32: the sums of
// their quants per block (blocks apart each).
template <Format F, int MR>
void multiply(const uint8_t* panel, bool streamed, int64_t blocks, int64_t K, const int8_t* qx, const float* dx,
              const float* ds, const int32_t* s32, const int32_t* sum16, float* out) {
  constexpr int kSubs = block_elems<F>() / 32;  // x's 32-blocks per panel block
  const int64_t panel_blocks = blocks / kSubs;
  VF acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = zero_f();
  for (int64_t pb = 0; pb < panel_blocks; ++pb) {
    const uint8_t* p = panel + pb * block_stride<F>();
    if (streamed) prefetch_ahead(panel, panel_blocks * block_stride<F>(), pb, panel_blocks);
    VI w[8];
    if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {
      constexpr bool five = F == Format::kQ5_K;
      VF dsc[8], dmn[8];
      k_scales<F>(p, dsc, dmn);
      for (int j = 0; j < 8; ++j) {
        for (int g = 0; g < 8; ++g) {
          const VI v = load_u(lane_vector<F>(p, (five ? 11 : 3) + (j / 2) * 8 + g));
          w[g] = j % 2 ? high_nibbles(v) : low_nibbles(v);
          if constexpr (five) w[g] = or_i(w[g], bits_to4(load_u(lane_vector<F>(p, 3 + g)), j, 1));
        }
        add_block<F, MR>(acc, w, dsc[j], dmn[j], pb * 8 + j, blocks, K, qx, dx, ds, s32);
      }
    } else if constexpr (F == Format::kQ6_K) {
      const VF d = halves(p);
      for (int h = 0; h < 2; ++h)
        for (int j = 0; j < 4; ++j) {  // x's 32-block 8 pb + 4h + j: weights 128h + 32j ..
          for (int g = 0; g < 8; ++g) {
            const VI ql = load_u(lane_vector<F>(p, 16 * h + 8 * (j % 2) + g));
            const VI qh = load_u(lane_vector<F>(p, 32 + 8 * h + g));
            w[g] = or_i(j / 2 ? high_nibbles(ql) : low_nibbles(ql), bits_to4(qh, 2 * j, 3));
          }
          const VI sc = load_u(lane_vector<F>(p, 48 + 2 * h + j / 2));  // scales 8h + 2j, + 1
          const VF dsa = mul_f(d, to_f(byte_i(sc, 2 * (j % 2)))), dsb = mul_f(d, to_f(byte_i(sc, 2 * (j % 2) + 1)));
          add_q6_block<MR>(acc, w, dsa, dsb, pb * 8 + 4 * h + j, blocks, K, qx, dx, sum16);
        }
    } else {
      for (int g = 0; g < 8; ++g) w[g] = weight_operand<F>(p, g);
      const VF mw = scales<F>() == 2 ? halves(p + 2 * kLanes) : zero_f();
      add_block<F, MR>(acc, w, halves(p), mw, pb, blocks, K, qx, dx, ds, s32);
    }
  }
  for (int r = 0; r < MR; ++r) store_f(out + r * kLanes, acc[r]);
}

}  // namespace int8_panel
}  // namespace pagedserve_cpu
