// Prototype for bench/cpu/decode_study.py (issue 25, phase A), not a product kernel:
// y = x @ W.T for one token, W [N, K] in bf16 or fp32 row-major, streamed once at
// memory speed. Four rows at a time share each load of x; bf16 is widened to fp32 by a
// shift (exact), products accumulate in fp32. Rows are split over torch's threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

inline float widen(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float widen(float f) { return f; }

template <typename W>
void rows(const W* w, const float* x, float* y, int64_t r0, int64_t r1, int64_t K) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const W* w0 = w + r * K;
    const W* w1 = w0 + K;
    const W* w2 = w1 + K;
    const W* w3 = w2 + K;
    float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[k];
      a0 += widen(w0[k]) * xv;
      a1 += widen(w1[k]) * xv;
      a2 += widen(w2[k]) * xv;
      a3 += widen(w3[k]) * xv;
    }
    y[r] = a0, y[r + 1] = a1, y[r + 2] = a2, y[r + 3] = a3;
  }
  for (; r < r1; ++r) {
    const W* w0 = w + r * K;
    float a0 = 0;
#pragma omp simd reduction(+ : a0)
    for (int64_t k = 0; k < K; ++k) a0 += widen(w0[k]) * x[k];
    y[r] = a0;
  }
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && weight.dim() == 2 && weight.is_contiguous(), "x [1, K], W [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({1, N}, x.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / 4, 16, [&](int64_t b, int64_t e) {
    const int64_t r1 = e * 4 == (N / 4) * 4 ? N : e * 4;  // the last chunk takes the tail rows
    if (weight.scalar_type() == at::kBFloat16)
      rows(reinterpret_cast<const uint16_t*>(weight.data_ptr()), xp, yp, b * 4, r1, K);
    else
      rows(weight.data_ptr<float>(), xp, yp, b * 4, r1, K);
  });
  return y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(pagedserve_proto, m) { m.def("gemv(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(pagedserve_proto, CPU, m) { m.impl("gemv", &gemv); }
