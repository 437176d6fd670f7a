// Linear layers over GGUF's quantized blocks with int8 activations (--quant-activations
// int8): y = x @ W.T as llama.cpp computes it. Each row of x is quantized per 32-block
// (d = amax / 127, q = round(x * 127 / amax) to nearest even, |q| <= 127) once per
// call; a block's product is then an integer dot product of the weights' quants and x's
// quants, exact, scaled by the two blocks' scales in fp32. The reference with the same
// signature is kernels/gguf_quant.py's quant_linear_int8 (the test oracle): it quantizes
// x with the same fp32 operations, so x's quants and scales are the same here and there,
// and the only difference is the fp32 rounding of the scale products and their sums.
//
// Why: a weight's decode is a few integer instructions per 32 weights (no widening to
// fp32), which is what bounds a decode step's few rows (quant_linear_cpu.cpp, the fp32
// path, is what --quant-activations none and the exactness tests run). The price is x's
// rounding to 8 bits per 32-block: the tokens move off the fp32 path's
// (bench/results/cpu_gguf_step.md: how far). From kScaledFrom rows the decode is paid
// once per panel and the multiply bounds the step: there x's quants, scaled back to fp32,
// go through the fp32 path's packed tiles (one AVX2 core, Q4_1 576 x 1536: 32 rows
// 53-56 GFLOP/s against the int8 tiles' 29-43, 256 rows 47-61 against 27-31).
//
// Where the build has AVX2, FMA and F16C, the formats of the shipped models (Q8_0, Q4_0,
// Q4_1) run quant_int8_avx2.h's tiles over the blocks as the file has them. The others
// (Q5_0, Q5_1, the K-quants), and every format on a build without AVX2, decode a group of
// weight rows into int8 quants with a scale and an offset per 16 weights, then multiply
// them by every row of x with plain loops the compiler vectorizes.
//
// Op (torch.ops.pagedserve_cpu): quant_linear_int8(x, data, qtype, out_features) -> y;
// x [M, K] fp32 or bf16 with contiguous rows, data uint8 [N, K / block * block_bytes],
// y [M, N] in x's dtype, rounded once from the fp32 sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "gguf_formats.h"
#include "quant_linear_cpu.h"
#include "work_pool.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_INT8_AVX2 1
#include "quant_int8_avx2.h"
#endif

namespace {

using namespace pagedserve_cpu;

// x quantized: quants [M][K], a scale per 32-block [M][K / 32], the sums of the quants
// per 16 [M][K / 16] (the factor of the offsets and the affine formats' m), and per
// 32-block the scale times the sum (ds [M][K / 32], as llama.cpp's Q8_1 keeps it).
struct QuantizedX {
  int64_t M, K;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
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

template <typename T>
QuantizedX quantize_x(const T* x, int64_t ldx, int64_t M, int64_t K) {
  QuantizedX out{M, K, std::vector<int8_t>(M * K), std::vector<float>(M * K / 32), std::vector<int32_t>(M * K / 16),
                 std::vector<float>(M * K / 32)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      int8_t* q = out.q.data() + m * K + b * 32;
      out.d[m * (K / 32) + b] = quantize_block(x + m * ldx + b * 32, q);
      for (int h = 0; h < 2; ++h) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += q[h * 16 + i];
        out.sum16[m * (K / 16) + b * 2 + h] = s;
      }
      out.ds[m * (K / 32) + b] = out.d[m * (K / 32) + b] *
                                 static_cast<float>(out.sum16[m * (K / 16) + b * 2] + out.sum16[m * (K / 16) + b * 2 + 1]);
    }
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

template <typename T>
void store(T* y, float v) {
  if constexpr (std::is_same_v<T, float>)
    *y = v;
  else
    *y = float_to_bf16_bits(v);
}

constexpr int kRows = 4;  // weight rows decoded together (generic path)

// The generic path: kRows weight rows at a time decoded into int8 quants, then multiplied
// by every row of x.
template <Format F, typename T>
void run_generic(const QuantizedX& x, const FormatInfo& fi, const uint8_t* data, int64_t N, T* y) {
  const int64_t K = x.K, row_bytes = K / fi.elems * fi.bytes, blocks = K / fi.elems, subs = K / 16;
  share_items((N + kRows - 1) / kRows, kRows * K * x.M, [&](int64_t g0, int64_t g1) {
    std::vector<int8_t> q(kRows * K);
    std::vector<float> dw(kRows * subs), mw(kRows * subs);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n0));
      for (int r = 0; r < rows; ++r)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t e = r * K + blk * fi.elems;
          decode_int<F>(data + (n0 + r) * row_bytes + blk * fi.bytes, q.data() + e, dw.data() + e / 16,
                        mw.data() + e / 16);
        }
      for (int64_t m = 0; m < x.M; ++m) {
        const int8_t* xq = x.q.data() + m * K;
        for (int r = 0; r < rows; ++r) {
          const int8_t* wq = q.data() + r * K;
          float acc = 0.0f;
          for (int64_t s = 0; s < subs; ++s) {
            int32_t dot = 0;
            for (int i = 0; i < 16; ++i) dot += static_cast<int32_t>(wq[s * 16 + i]) * xq[s * 16 + i];
            const float dx = x.d[m * (K / 32) + s / 2];
            acc += dw[r * subs + s] * dx * static_cast<float>(dot) +
                   mw[r * subs + s] * dx * static_cast<float>(x.sum16[m * subs + s]);
          }
          store(y + m * N + n0 + r, acc);
        }
      }
    }
  });
}

#ifdef PAGEDSERVE_INT8_AVX2
template <Format F>
constexpr bool avx2_format() {
  return F == Format::kQ8_0 || F == Format::kQ4_0 || F == Format::kQ4_1;
}

// out[r][n] += the offset terms of Q4_0 (-8 * d) and Q4_1 (m): per block, the offset
// times x's scale times the sum of x's quants over the block (x.ds).
template <Format F, int MR, int NR>
void affine_terms(const uint8_t* w, int64_t row_bytes, const QuantizedX& x, int64_t m0, float* out) {
  if constexpr (F != Format::kQ8_0) {
    constexpr int kBytes = block_bytes<F>();
    const int64_t blocks = x.K / 32;
    float acc[MR][NR] = {};
    for (int64_t b = 0; b < blocks; ++b)
      for (int n = 0; n < NR; ++n) {
        const uint8_t* blk = w + n * row_bytes + b * kBytes;
        const float offset = F == Format::kQ4_0 ? -8.0f * qdot::half(blk) : qdot::half(blk + 2);
        for (int r = 0; r < MR; ++r) acc[r][n] += offset * x.ds[(m0 + r) * blocks + b];
      }
    for (int r = 0; r < MR; ++r)
      for (int n = 0; n < NR; ++n) out[r * NR + n] += acc[r][n];
  }
}

// y[m0:m0+MR, n0:n0+NR], rounded once to y's dtype.
template <Format F, int MR, int NR, typename T>
void avx2_tile(const uint8_t* data, int64_t row_bytes, const QuantizedX& x, int64_t m0, int64_t n0, T* y,
               int64_t N) {
  float out[MR * NR];
  const uint8_t* w = data + n0 * row_bytes;
  qdot::tile<F, MR, NR>(w, row_bytes, x.K, x.q.data() + m0 * x.K, x.d.data() + m0 * (x.K / 32), out, NR);
  affine_terms<F, MR, NR>(w, row_bytes, x, m0, out);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) store(y + (m0 + r) * N + n0 + n, out[r * NR + n]);
}

// The output rows shared out over the threads (work_pool.h) in groups of kNR; a group's weight rows (a few
// hundred bytes each) stay in L1 while every row of x passes under them, so the weights
// are read from memory once per call. A few rows of x (a decode): MR = 1 or 2 by 4
// weight rows; more (a batch): 4 by 2, each decoded block serving 4 rows of x.
constexpr int kNR = 4;

template <Format F, int MR, int NR, typename T>
void tiles_over_rows(const uint8_t* data, int64_t row_bytes, const QuantizedX& x, int64_t n0, int64_t n1, T* y,
                     int64_t N) {
  for (int64_t n = n0; n < n1; n += NR) {
    int64_t m = 0;
    for (; m + MR <= x.M; m += MR) {
      if (n + NR <= n1)
        avx2_tile<F, MR, NR>(data, row_bytes, x, m, n, y, N);
      else
        for (int64_t k = n; k < n1; ++k) avx2_tile<F, MR, 1>(data, row_bytes, x, m, k, y, N);
    }
    for (; m < x.M; ++m) {
      if (n + NR <= n1)
        avx2_tile<F, 1, NR>(data, row_bytes, x, m, n, y, N);
      else
        for (int64_t k = n; k < n1; ++k) avx2_tile<F, 1, 1>(data, row_bytes, x, m, k, y, N);
    }
  }
}

template <Format F, typename T>
void run_avx2(const QuantizedX& x, const uint8_t* data, int64_t N, T* y) {
  const int64_t row_bytes = pagedserve_cpu::row_bytes<F>(x.K);
  share_items((N + kNR - 1) / kNR, kNR * x.K * x.M, [&](int64_t g0, int64_t g1) {
    const int64_t n0 = g0 * kNR, n1 = std::min(N, g1 * kNR);
    if (x.M < 4)
      tiles_over_rows<F, 2, 4>(data, row_bytes, x, n0, n1, y, N);
    else
      tiles_over_rows<F, 4, 2>(data, row_bytes, x, n0, n1, y, N);
  });
}
#endif

// From kScaledFrom rows of x (a prefill, a step of many streams), x's quants are scaled
// back to fp32 (d * q, rounded once) and multiplied by the fp32 path's packed tiles: the
// same x's quants and scales as the int8 tiles, so the same product up to fp32
// rounding, the bound the tests hold both to.
constexpr int64_t kScaledFrom = 16;

at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& data, c10::string_view qtype,
                             int64_t out_features) {
  const FormatInfo fi = checked_format(x, data, qtype, out_features, "quant_linear_int8");
  const int64_t K = x.size(1);
  if (x.size(0) >= kScaledFrom) {
    const at::Tensor x_hat =
        x.scalar_type() == at::kFloat
            ? scaled_back(x.data_ptr<float>(), x.stride(0), x.size(0), K)
            : scaled_back(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), x.size(0), K);
    return quant_linear(x_hat, data, qtype, out_features).to(x.scalar_type());
  }
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
  const uint8_t* d = data.data_ptr<uint8_t>();
  const auto go = [&](auto format) {
    constexpr Format F = decltype(format)::value;
    const auto with = [&](auto* xp, auto* yp) {
      const QuantizedX xq = quantize_x(xp, x.stride(0), x.size(0), K);
#ifdef PAGEDSERVE_INT8_AVX2
      if constexpr (avx2_format<F>()) {
        run_avx2<F>(xq, d, out_features, yp);
        return;
      }
#endif
      run_generic<F>(xq, fi, d, out_features, yp);
    };
    if (x.scalar_type() == at::kFloat)
      with(x.data_ptr<float>(), y.data_ptr<float>());
    else
      with(reinterpret_cast<const uint16_t*>(x.data_ptr()), reinterpret_cast<uint16_t*>(y.data_ptr()));
  };
  dispatch(fi.format, go);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_linear_int8(Tensor x, Tensor data, str qtype, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("quant_linear_int8", &quant_linear_int8); }
