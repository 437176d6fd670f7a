// GGUF's quantized blocks decoded into int8 quants with, per 16 weights, a scale and an
// offset (w = dw * q + mw): the generic int8-activation path of builds without AVX2
// (quant_int8_cpu.cpp's run_generic multiplies them by x's int8 quants). The AVX2
// builds read the blocks in registers instead (quant_int8_avx2.h, quant_int8_panel.h).
#pragma once

#include <cstdint>
#include <cstring>

#include "gguf_formats.h"

namespace pagedserve_cpu {

// A block's quants as int8 with, per 16 weights, a scale and an offset: w = dw * q + mw.
template <Format F>
void decode_int(const uint8_t* b, int8_t* q, float* dw, float* mw) {
  if constexpr (F == Format::kQ4_K || F == Format::kQ5_K) {
    constexpr bool five = F == Format::kQ5_K;
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (five ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      k_scale_min(b + 4, j, &sc, &mn);
      dw[2 * j] = dw[2 * j + 1] = d * static_cast<float>(sc);
      mw[2 * j] = mw[2 * j + 1] = -(dmin * static_cast<float>(mn));
      for (int i = 0; i < 32; ++i) {
        int v = (qs[(j / 2) * 32 + i] >> ((j % 2) * 4)) & 0x0F;
        if constexpr (five) v |= ((qh[i] >> j) & 1) << 4;
        q[j * 32 + i] = static_cast<int8_t>(v);
      }
    }
  } else if constexpr (F == Format::kQ6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16(b + 208);
    for (int s = 0; s < 16; ++s) dw[s] = d * static_cast<float>(sc[s]), mw[s] = 0.0f;
    for (int half = 0; half < 2; ++half)
      for (int j = 0; j < 4; ++j)  // 4 runs of 32 per half: low nibbles of ql[0:32], ql[32:64], then high
        for (int i = 0; i < 32; ++i) {
          const int l = (ql[half * 64 + (j % 2) * 32 + i] >> ((j / 2) * 4)) & 0x0F;
          const int h = (qh[half * 32 + i] >> (2 * j)) & 3;
          q[half * 128 + j * 32 + i] = static_cast<int8_t>((l | (h << 4)) - 32);
        }
  } else {
    constexpr bool affine = F == Format::kQ4_1 || F == Format::kQ5_1;
    constexpr bool five = F == Format::kQ5_0 || F == Format::kQ5_1;
    const float d = f16(b);
    dw[0] = dw[1] = d;
    mw[0] = mw[1] = affine ? f16(b + 2) : 0.0f;
    const uint8_t* p = b + (affine ? 4 : 2);
    if constexpr (F == Format::kQ8_0) {
      std::memcpy(q, p, 32);
      return;
    }
    uint32_t qh = 0;
    if constexpr (five) {
      std::memcpy(&qh, p, 4);
      p += 4;
    }
    constexpr int offset = affine ? 0 : (five ? 16 : 8);
    for (int i = 0; i < 16; ++i) {
      int lo = p[i] & 0x0F, hi = p[i] >> 4;
      if constexpr (five) lo |= ((qh >> i) & 1) << 4, hi |= ((qh >> (i + 16)) & 1) << 4;
      q[i] = static_cast<int8_t>(lo - offset);
      q[i + 16] = static_cast<int8_t>(hi - offset);
    }
  }
}

}  // namespace pagedserve_cpu
