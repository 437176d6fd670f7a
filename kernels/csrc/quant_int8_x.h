// Activations quantized for the int8-activation kernels (quant_int8_cpu.cpp): each row
// of x per 32-block, d = amax / 127, q = round(x * 127 / amax) to nearest even, in the
// same fp32 operations as kernels/gguf_quant.py's quantize_activations (the test oracle),
// so both get the same quants and scales. Included by quant_int8_cpu.cpp only.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "work_pool.h"
#ifdef PAGEDSERVE_INT8_AVX2
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

// x quantized: quants [M][K], a scale per 32-block [M][K / 32], the sums of the quants
// per 16 [M][K / 16] (the factor of the offsets and the affine formats' m) and per
// 32-block [M][K / 32], and per 32-block the scale times the sum (ds [M][K / 32], as
// llama.cpp's Q8_1 keeps it).
struct QuantizedX {
  int64_t M, K;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16, sum32;
  std::vector<float> ds;
};

// Without reassociation (the build allows it): GCC may fold x * (127 / amax) into
// (x * 127) / amax, another rounding than the reference's, and a tie would round apart.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")
// One 32-block of x quantized: its quants into q; returns its scale. The same fp32
// operations in vectors where x is fp32 (the scalar loop called libm's nearbyint per
// element: a third of a prefill's int8 multiply); round to nearest even either way.
template <typename T>
float quantize_block(const T* x, int8_t* q) {
#ifdef PAGEDSERVE_INT8_AVX2
  if constexpr (std::is_same_v<T, float>) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      top = _mm256_max_ps(top, _mm256_and_ps(v[i], magnitude));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
    alignas(32) int32_t lanes[8];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(r));
      for (int j = 0; j < 8; ++j) q[8 * i + j] = static_cast<int8_t>(lanes[j]);
    }
    return amax / 127.0f;
  }
#endif
  float v[32];
  float amax = 0.0f;
  for (int i = 0; i < 32; ++i) {
    if constexpr (std::is_same_v<T, float>)
      v[i] = x[i];
    else
      v[i] = bf16_to_float(x[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::nearbyint(v[i] * id));
  return amax / 127.0f;
}

// The rows shared by the threads, as scaled_back's: at a batch's rows the panels left
// this a larger share of the call.
template <typename T>
QuantizedX quantize_x(const T* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  QuantizedX out{M, K, std::vector<int8_t>(M * K), std::vector<float>(M * blocks), std::vector<int32_t>(M * K / 16),
                 std::vector<int32_t>(M * blocks), std::vector<float>(M * blocks)};
  share_items(M, K * 4, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t i = m * blocks + b;
        int8_t* q = out.q.data() + m * K + b * 32;
        out.d[i] = quantize_block(x + m * ldx + b * 32, q);
        for (int h = 0; h < 2; ++h) {
          int32_t s = 0;
          for (int j = 0; j < 16; ++j) s += q[h * 16 + j];
          out.sum16[2 * i + h] = s;
        }
        out.sum32[i] = out.sum16[2 * i] + out.sum16[2 * i + 1];
        out.ds[i] = out.d[i] * static_cast<float>(out.sum32[i]);
      }
  });
  return out;
}

// x's quants scaled back to fp32 (d * q, rounded once) [M, K], the rows shared by the
// threads: at a prefill's rows, done on one thread this took a third of the multiply.
template <typename T>
at::Tensor scaled_back(const T* x, int64_t ldx, int64_t M, int64_t K) {
  at::Tensor out = at::empty({M, K}, at::kFloat);
  float* o = out.data_ptr<float>();
  share_items(M, K * 4, [&](int64_t m0, int64_t m1) {
    int8_t q[32];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {
        const float d = quantize_block(x + m * ldx + b * 32, q);
        for (int i = 0; i < 32; ++i) o[m * K + b * 32 + i] = d * static_cast<float>(q[i]);
      }
  });
  return out;
}
#pragma GCC pop_options

}  // namespace pagedserve_cpu
