// The mixture-of-experts op for the CPU (kernels/moe_reference.py's fused_moe, the
// oracle): only the selected experts are computed. The (token, slot) pairs are
// grouped by expert (a counting sort); each expert with tokens multiplies its rows
// once through the packed linear kernel (linear_cpu.cpp): the gate-up projection
// fused with the activation, then the down projection. A decode step of one token
// and top-k experts reads k experts' weights, not all E: its cost follows the active
// parameters.
//
// The weighted sum runs over the experts in index order into fp32, as the reference
// adds them, and is rounded once to x's dtype.
//
// Op (torch.ops.pagedserve_cpu): fused_moe(x [T, H], topk_ids [T, K] int64,
// topk_weights [T, K] fp32, gate_up [E, L1], down [E, L2], intermediate, activation)
// -> [T, H]; gate_up and down hold each expert's pack_linear(W, gated=True) and
// pack_linear(W) rows.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

#include "linear_cpu.h"

namespace {

at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& gate_up, const at::Tensor& down, int64_t intermediate,
                     c10::string_view activation) {
  TORCH_CHECK(x.dim() == 2, "fused_moe: x must be [T, H]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0), "fused_moe: topk_ids must be [T, K]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "fused_moe: topk_weights must be shaped like topk_ids");
  TORCH_CHECK(gate_up.dim() == 2 && down.dim() == 2 && gate_up.size(0) == down.size(0),
              "fused_moe: gate_up and down must be [E, packed] for the same experts");
  TORCH_CHECK(!activation.empty(), "fused_moe: the experts' activation is required");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1), experts = gate_up.size(0);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* w = weights.data_ptr<float>();

  // Counting sort of the (token, slot) pairs by expert, tokens ascending within one.
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "fused_moe: expert id ", id[i], " out of range");
    ++start[id[i] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1), pair(tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) pair[fill[id[i]]++] = i;

  at::Tensor acc = at::zeros({tokens, hidden}, x.options().dtype(at::kFloat));
  float* out = acc.data_ptr<float>();
  const at::Tensor xs = x.contiguous();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    std::vector<int64_t> rows(n);
    for (int64_t r = 0; r < n; ++r) rows[r] = pair[start[e] + r] / top_k;
    const at::Tensor index = at::from_blob(rows.data(), {n}, at::kLong);
    const at::Tensor h = pagedserve_cpu::linear_packed(xs.index_select(0, index), gate_up[e], intermediate, hidden,
                                                       activation);
    const at::Tensor y = pagedserve_cpu::linear_packed(h, down[e], hidden, intermediate, "").to(at::kFloat);
    const float* yr = y.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const int64_t p = pair[start[e] + r];
      const float weight = w[p];
      float* o = out + (p / top_k) * hidden;
      const float* src = yr + r * hidden;
      for (int64_t c = 0; c < hidden; ++c) o[c] += src[c] * weight;
    }
  }
  return acc.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def(
      "fused_moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor gate_up, Tensor down, int intermediate, "
      "str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("fused_moe", &fused_moe); }
