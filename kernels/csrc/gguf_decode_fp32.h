// GGUF's quantized blocks decoded into fp32 with exactly the reference's arithmetic
// (kernels/gguf_quant.py): the fp16 scales widened exactly, then the same fp32 products
// and sums in the same order, with floating-point contraction off (an FMA would round
// d * q + m once where the reference rounds twice), so the decoded weights are the
// reference's bit for bit. quant_linear_cpu.cpp's generic path multiplies what these
// decode; the fused AVX2 paths decode in registers instead (quant_fused_avx2.h,
// quant_kquant_avx2.h).
#pragma once

#include <cstdint>

#include "cpu_vec.h"
#include "gguf_formats.h"

namespace pagedserve_cpu {

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// {0, 1, ..., kLanes - 1}
inline vint lane_index() {
  vint v;
  for (int i = 0; i < kLanes; ++i) v[i] = i;
  return v;
}

// 32 weights of a Q8_0 / Q4 / Q5 block, q = nibble (low nibbles: 0-15, high: 16-31) | 5th
// bit. One template per format: branch-free loops the compiler vectorizes.
template <Format F>
inline void decode_32(const uint8_t* __restrict b, float* __restrict out) {
  if constexpr (F == Format::kQ8_0) {
    const float d = f16(b);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
  } else {
    constexpr bool affine = F == Format::kQ4_1 || F == Format::kQ5_1;  // d * q + m
    constexpr bool five = F == Format::kQ5_0 || F == Format::kQ5_1;
    constexpr int offset = affine ? 0 : (five ? 16 : 8);
    const float d = f16(b);
    const float m = affine ? f16(b + 2) : 0.0f;
    const uint8_t* p = b + (affine ? 4 : 2);
    uint32_t qh = 0;
    if constexpr (five) {
      std::memcpy(&qh, p, 4);
      p += 4;
    }
    // kLanes nibbles at a time as vectors (the bytes widened to 32-bit lanes, masked and
    // shifted there): low nibbles are weights 0-15, high nibbles 16-31.
    typedef uint8_t vbyte __attribute__((vector_size(kLanes)));
    const vuint lane = __builtin_convertvector(vint{} + lane_index(), vuint);
    for (int i = 0; i < 16; i += kLanes) {
      vbyte bytes;
      std::memcpy(&bytes, p + i, sizeof bytes);
      const vuint u = __builtin_convertvector(bytes, vuint);
      for (int hi = 0; hi < 2; ++hi) {
        const int e = hi * 16 + i;
        vuint q = hi ? u >> 4 : u & 0x0Fu;
        if constexpr (five) q |= ((vuint{} + qh) >> (lane + static_cast<uint32_t>(e)) & 1u) << 4;
        // Through signed lanes: AVX2 has no unsigned int -> float conversion (GCC would
        // emulate one), and q < 32 either way.
        const vfloat qf = __builtin_convertvector(__builtin_convertvector(q, vint) - offset, vfloat);
        vfloat w;
        if constexpr (affine)
          w = d * qf + m;
        else
          w = d * qf;
        std::memcpy(out + e, &w, sizeof w);  // not cpu_vec.h's vstore: built without this region's
                                              // options, GCC would call it instead of inlining it
      }
    }
  }
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each (d * scale) * q - (dmin * min), 6-bit scales and mins.
template <bool Five>
inline void decode_k45(const uint8_t* __restrict b, float* __restrict out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* s = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (Five ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    k_scale_min(s, j, &sc, &mn);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = (j % 2) * 4;
    float* o = out + j * 32;
    for (int i = 0; i < 32; ++i) {
      int v = (q[i] >> shift) & 0x0F;
      if constexpr (Five) v |= ((qh[i] >> j) & 1) << 4;
      o[i] = dl * static_cast<float>(v) - ml;
    }
  }
}

// Q6_K: 16 sub-blocks of 16, each (d * scale) * (q - 32), q = 4 low bits | 2 high bits.
inline void decode_q6_k(const uint8_t* __restrict b, float* __restrict out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 4; ++j) {  // 4 runs of 32 per half: low nibbles of ql[0:32], ql[32:64], then high nibbles
      const uint8_t* l = ql + half * 64 + (j % 2) * 32;
      const uint8_t* h = qh + half * 32;
      const int lshift = (j / 2) * 4, hshift = 2 * j;
      const int e = half * 128 + j * 32;
      for (int part = 0; part < 2; ++part) {
        const float dl = d * static_cast<float>(sc[e / 16 + part]);
        for (int i = part * 16; i < part * 16 + 16; ++i) {
          const int v = ((l[i] >> lshift) & 0x0F) | (((h[i] >> hshift) & 3) << 4);
          out[e + i] = dl * static_cast<float>(v - 32);
        }
      }
    }
}

template <Format F>
inline void decode_block(const uint8_t* b, float* out) {
  if constexpr (F == Format::kQ4_K || F == Format::kQ5_K)
    decode_k45<F == Format::kQ5_K>(b, out);
  else if constexpr (F == Format::kQ6_K)
    decode_q6_k(b, out);
  else
    decode_32<F>(b, out);
}

// `rows` rows of W from row n0 into out [rows][K].
template <Format F>
void decode_rows(const FormatInfo& fi, const uint8_t* data, int64_t row_bytes, int64_t n0, int rows, int64_t K,
                 float* out) {
  const int64_t blocks = K / fi.elems;
  for (int r = 0; r < rows; ++r) {
    const uint8_t* row = data + (n0 + r) * row_bytes;
    for (int64_t blk = 0; blk < blocks; ++blk) decode_block<F>(row + blk * fi.bytes, out + r * K + blk * fi.elems);
  }
}

#pragma GCC pop_options

}  // namespace pagedserve_cpu
