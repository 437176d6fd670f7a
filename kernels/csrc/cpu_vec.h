// What the CPU kernels in this folder share: bf16 conversions, one vector register of
// fp32 lanes as a GCC vector extension, and exp for non-positive arguments.
//
// kLanes follows the widest vectors the build targets (-march=native, kernels/cpu_build.py):
// 16 with AVX-512, 8 otherwise (AVX2; the compiler splits a vector where registers are
// narrower still). No instruction set is assumed beyond what the compiler was told.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedserve_cpu {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef int32_t vint __attribute__((vector_size(kLanes * 4)));
typedef uint32_t vuint __attribute__((vector_size(kLanes * 4)));
typedef uint16_t vbf16 __attribute__((vector_size(kLanes * 2)));

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // a select, no branch
}

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vfloat vload(const uint16_t* p) {  // kLanes bf16 -> fp32: the bits shifted into place
  vbf16 h;
  std::memcpy(&h, p, sizeof h);
  const vint bits = __builtin_convertvector(h, vint) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
// kLanes fp16 -> fp32, exact: F16C's vcvtph2ps where the build has it (GCC 12 turns a
// vector conversion of _Float16 into one vcvtph2ps per lane), else lane by lane.
inline vfloat vload(const _Float16* p) {
  vfloat v;
#if defined(__F16C__) && defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#elif defined(__F16C__)
  const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &wide, sizeof v);
#else
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
inline void vstore(uint16_t* p, vfloat v) {  // fp32 -> bf16, as float_to_bf16_bits on every lane
  vuint u;
  std::memcpy(&u, &v, sizeof u);
  const vuint rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const vuint bits = (u & 0x7fffffffu) > 0x7f800000u ? vuint{} + 0x7fc0u : rounded;
  const vbf16 h = __builtin_convertvector(bits, vbf16);
  std::memcpy(p, &h, sizeof h);
}
inline vfloat vsplat(float x) { return vfloat{} + x; }
inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// Lane sums. vsum4 sums four vectors at once, [sum a, sum b, sum c, sum d], by a
// transposing tree of shuffles (~3 instructions a vector with AVX2): the dot products of
// a tile of keys reduce together instead of in four horizontal reductions.
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
inline vfloat8 vfold8(vfloat v) {  // the 8-lane partial sums of a vector
#if defined(__AVX512F__)
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}
inline vfloat4 vsum4(vfloat a, vfloat b, vfloat c, vfloat d) {
  const vfloat8 a8 = vfold8(a), b8 = vfold8(b), c8 = vfold8(c), d8 = vfold8(d);
  // [a (4 partials), b (4)], [c (4), d (4)]
  const vfloat8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
  const vfloat8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                     __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
  // [a a c c b b d d] (2 partials each)
  const vfloat8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                    __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(x, x, 0, 4, 2, 6) + __builtin_shufflevector(x, x, 1, 5, 3, 7);
}
inline float vhmax(vfloat v) {
  float r = v[0];
  for (int t = 1; t < kLanes; ++t) r = std::max(r, v[t]);
  return r;
}
inline float vsum(vfloat v) {
  const vfloat8 v8 = vfold8(v);
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// exp for x <= 0 (scores minus their running max; -|x| in the activations),
// vectorizable: 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6
// polynomial (~1 ulp).
inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return p * two_n;
}

// exp_neg on every lane, with round-to-nearest as trunc(y - 0.5) (y <= 0) and 2^n
// built in the exponent bits.
inline vfloat vexp_neg(vfloat x) {
  x = vmax(x, vsplat(-87.0f));
  const vfloat y = x * 1.44269504088896341f;
  const vint ni = __builtin_convertvector(y - 0.5f, vint);
  const vfloat n = __builtin_convertvector(ni, vfloat);
  vfloat r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  vfloat p = vsplat(1.0f / 720.0f);
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vint bits = (ni + 127) << 23;
  vfloat two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// tanh on every lane through exp(-2|x|), which cannot overflow: sign(x) (1 - e) / (1 + e).
inline vfloat vtanh(vfloat x) {
  const vfloat e = vexp_neg(x > 0 ? -2.0f * x : 2.0f * x);
  const vfloat t = (1.0f - e) / (1.0f + e);
  return x > 0 ? t : -t;
}


// A gated MLP's activation, act(g) * u on every lane (linear_cpu.cpp's fused gate-up
// epilogue and elementwise_cpu.cpp's gated_act): sigmoid and tanh through exp(-|.|),
// which cannot overflow.
enum class Act { kNone, kSilu, kGeluTanh };
inline vfloat activate(vfloat g, vfloat u, Act act) {
  if (act == Act::kSilu) {
    const vfloat e = vexp_neg(g > 0 ? -g : g);  // exp(-|g|)
    const vfloat s = 1.0f / (1.0f + e);           // sigmoid(|g|); one division, not two
    return g * (g > 0 ? s : e * s) * u;
  }
  const vfloat y = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2/pi) (g + 0.044715 g^3)
  return 0.5f * g * (1.0f + vtanh(y)) * u;
}
}  // namespace pagedserve_cpu
