// What every sampled row needs of its logits, in one read of them (kernels/reference.py's
// argmax_logsumexp, the test oracle): the row's argmax (the greedy token; the first index
// of the largest value, torch.argmax's rule) and its log-sum-exp (every logprob is a logit
// minus it). torch reads a 49k-token row twice for these, and its argmax is not
// vectorized: 110 us per row on one thread, a tenth of a decode step's work outside the
// forward at one stream and ~3 % of a 32-row decode step (AVX-512 EPYC, issue 38).
//
// The log-sum-exp is torch's formula, max + log(sum(exp(x - max))), with the exps summed
// in vectors of fp32 per 256 logits and those sums in double: within a few fp32 ulps of
// the exact value, not the same bits as torch's sum order. Rows holding a NaN, or whose
// largest value is infinite, take torch's results through the scalar rule.
//
// Op (torch.ops.pagedserve_cpu): argmax_logsumexp(logits fp32 [N, V], contiguous rows)
// -> (argmax int64 [N], logsumexp fp32 [N]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "cpu_vec.h"

namespace {

using namespace pagedserve_cpu;

constexpr int64_t kSumBlock = 256;  // logits summed in fp32 vectors before a double sum

// The scalar rule: torch's results where a NaN or an infinite maximum makes the vector
// pass's arithmetic meaningless (NaN wins the argmax and makes the sum NaN; +inf wins it
// and gives +inf; a row of -inf has argmax 0 and log-sum-exp -inf).
std::tuple<int64_t, float> special_row(const float* x, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return {i, x[i]};
    if (x[i] > x[best]) best = i;
  }
  return {best, x[best]};  // +inf or -inf: the log-sum-exp is the maximum itself
}

// The row's largest value and whether it is finite with no NaN anywhere in the row.
std::tuple<float, bool> row_max(const float* x, int64_t V) {
  vfloat m = vsplat(-std::numeric_limits<float>::infinity());
  vint nan = vint{} + 0;
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    const vfloat v = vload(x + i);
    nan |= v != v;
    m = vmax(m, v);
  }
  float top = vhmax(m);
  bool clean = true;
  for (int t = 0; t < kLanes; ++t) clean &= nan[t] == 0;
  for (; i < V; ++i) {
    clean &= !std::isnan(x[i]);
    top = std::max(top, x[i]);
  }
  return {top, clean && std::isfinite(top)};
}

int64_t first_index_of(const float* x, int64_t V, float value) {
  int64_t i = 0;
  const vfloat target = vsplat(value);
  for (; i + kLanes <= V; i += kLanes) {
    const vint hit = vload(x + i) == target;
    for (int t = 0; t < kLanes; ++t)
      if (hit[t]) return i + t;
  }
  for (; i < V; ++i)
    if (x[i] == value) return i;
  return 0;  // unreachable: `value` is the row's maximum
}

float log_sum_exp(const float* x, int64_t V, float top) {
  double total = 0.0;
  for (int64_t start = 0; start < V; start += kSumBlock) {
    const int64_t end = std::min(V, start + kSumBlock);
    vfloat acc = vsplat(0.0f);
    int64_t i = start;
    for (; i + kLanes <= end; i += kLanes) acc += vexp_neg(vload(x + i) - top);
    float block = vsum(acc);
    for (; i < end; ++i) block += exp_neg(x[i] - top);
    total += block;
  }
  return top + static_cast<float>(std::log(total));
}

std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, "argmax_logsumexp: logits must be [N, V]");
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "argmax_logsumexp: logits must be fp32");
  TORCH_CHECK(logits.stride(1) == 1, "argmax_logsumexp: logits rows must be contiguous");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "argmax_logsumexp: rows must not be empty");
  at::Tensor index = at::empty({N}, logits.options().dtype(at::kLong));
  at::Tensor lse = at::empty({N}, logits.options());
  const float* base = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  int64_t* index_out = index.data_ptr<int64_t>();
  float* lse_out = lse.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = base + r * ld;
      const auto [top, clean] = row_max(x, V);
      if (!clean) {
        std::tie(index_out[r], lse_out[r]) = special_row(x, V);
        continue;
      }
      index_out[r] = first_index_of(x, V, top);
      lse_out[r] = log_sum_exp(x, V, top);
    }
  });
  return {index, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("argmax_logsumexp(Tensor logits) -> (Tensor, Tensor)"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("argmax_logsumexp", &argmax_logsumexp); }
