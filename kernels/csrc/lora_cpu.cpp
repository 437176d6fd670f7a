// The batched LoRA op for the CPU (kernels/lora_reference.py's lora, the oracle):
// y[t] = b[slot] @ (a[slot] @ x[t]) for each token's adapter slot. The tokens are
// grouped by slot (a counting sort, tokens ascending within one), so the threads
// walk each adapter's A and B for a run of its tokens while they sit in cache;
// slot 0 (the base model, all zeros) is skipped and its rows stay zero. Sums run
// in fp32; the shrink is rounded to x's dtype before the expand, as the reference
// (two chained matmuls in x's dtype) rounds it, and the output once.
//
// Op (torch.ops.pagedserve_cpu): lora(x [T, in], a [S, R, in], b [S, out, R],
// slots [T] int64) -> [T, out], x, a and b of one dtype (fp32 or bf16).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

template <typename T>
void lora_rows(const T* x, const T* a, const T* b, T* y, const std::vector<int64_t>& order,
               const std::vector<int64_t>& slot_of, int64_t in, int64_t rank, int64_t out) {
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xs(in), h(rank);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = order[i], s = slot_of[i];
      const T* xt = x + t * in;
      for (int64_t k = 0; k < in; ++k) xs[k] = static_cast<float>(xt[k]);
      const T* as = a + s * rank * in;
      for (int64_t r = 0; r < rank; ++r) {
        const T* ar = as + r * in;
        float acc = 0.f;
        for (int64_t k = 0; k < in; ++k) acc += static_cast<float>(ar[k]) * xs[k];
        h[r] = static_cast<float>(static_cast<T>(acc));
      }
      const T* bs = b + s * out * rank;
      T* yt = y + t * out;
      for (int64_t o = 0; o < out; ++o) {
        const T* bo = bs + o * rank;
        float acc = 0.f;
        for (int64_t r = 0; r < rank; ++r) acc += static_cast<float>(bo[r]) * h[r];
        yt[o] = static_cast<T>(acc);
      }
    }
  });
}

at::Tensor lora(const at::Tensor& x, const at::Tensor& a, const at::Tensor& b, const at::Tensor& slots) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 3 && b.dim() == 3, "lora: x [T, in], a [S, R, in], b [S, out, R]");
  TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == b.size(2) && a.size(2) == x.size(1),
              "lora: a and b must be [S, R, in] and [S, out, R] over x's in");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0), "lora: slots must be [T]");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
              "lora: x, a and b must share a dtype");
  const int64_t tokens = x.size(0), in = x.size(1), num_slots = a.size(0), rank = a.size(1), out = b.size(1);
  const at::Tensor ids = slots.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(num_slots + 1, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < num_slots, "lora: slot ", id[t], " out of range");
    ++start[id[t] + 1];
  }
  for (int64_t s = 0; s < num_slots; ++s) start[s + 1] += start[s];
  const int64_t adapted = tokens - start[1];  // tokens outside slot 0
  std::vector<int64_t> fill(start.begin(), start.end() - 1), order(adapted), slot_of(adapted);
  for (int64_t t = 0; t < tokens; ++t) {
    if (id[t] == 0) continue;
    const int64_t at = fill[id[t]]++ - start[1];
    order[at] = t;
    slot_of[at] = id[t];
  }
  at::Tensor y = at::zeros({tokens, out}, x.options());
  if (adapted == 0) return y;
  const at::Tensor xs = x.contiguous(), as = a.contiguous(), bs = b.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "lora", [&] {
    lora_rows<scalar_t>(xs.data_ptr<scalar_t>(), as.data_ptr<scalar_t>(), bs.data_ptr<scalar_t>(),
                        y.data_ptr<scalar_t>(), order, slot_of, in, rank, out);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) { m.def("lora(Tensor x, Tensor a, Tensor b, Tensor slots) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("lora", &lora); }
