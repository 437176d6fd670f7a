// The fused element-wise work of a decoder layer on the CPU (issue 27, fault 9), with
// the semantics of kernels/reference.py (the test oracle):
//
//   add_rms_norm(x, residual?, weight, eps) -> (normed, summed): summed = residual + x
//     rounded to x's dtype, normed = summed * rsqrt(mean(summed^2) + eps) * weight,
//     computed in fp32 and rounded once. One pass per row instead of the add, the cast,
//     the norm and the cast back.
//   rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> (q', k'): the
//     rotate-half RoPE of q and k (in fp32, rounded once to their dtype), and k', v
//     written at their slots (< 0: skipped) of an unquantized cache. One pass over the
//     step's q, k and v instead of ~12 ops per layer; q, k, v may be the strided slices
//     of one fused QKV projection.
//   gated_act(y, activation) -> act(gate) * up for y = [gate, up] [T, 2I] (fp32 or bf16),
//     activation "silu" or "gelu_tanh": the gated MLP's activation where the projection's
//     kernel does not fuse it (GGUF blocks, a bias before it), computed as linear_cpu.cpp's
//     fused epilogue computes it (cpu_vec.h's activate), rounded once. One pass instead
//     of the chunk, the activation and the product (a prefill of 2,048 rows of SmolLM2
//     spent 80 ms of 1.4 s in aten's silu and mul).
//
// The reference rounds after every op in a narrow dtype (x * cos, then + ...); these
// round once, so bf16 results may differ from it by an ulp of bf16 (fp32: the last bit).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu_vec.h"
#include "work_pool.h"

namespace {

using namespace pagedserve_cpu;

// Element types as fp32: load and the rounding store.
template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};
template <>
struct Elem<uint16_t> {  // bf16
  static float load(uint16_t x) { return bf16_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16_bits(x); }
};
template <>
struct Elem<_Float16> {
  static float load(_Float16 x) { return static_cast<float>(x); }
  static _Float16 store(float x) { return static_cast<_Float16>(x); }
};

template <typename Fn>
void dispatch(at::ScalarType t, Fn&& fn) {
  switch (t) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(uint16_t{}); break;
    case at::kHalf: fn(_Float16{}); break;
    default: TORCH_CHECK(false, "unsupported dtype ", t, " (fp32, bf16 or fp16)");
  }
}

// ---- add + RMSNorm ----------------------------------------------------------------------
template <typename T>
void add_rms_norm_rows(const T* x, int64_t ldx, const T* res, int64_t ldr, const float* w, T* normed, T* summed,
                       int64_t h, float eps, int64_t r0, int64_t r1) {
  std::vector<float> s(static_cast<size_t>(h));
  for (int64_t r = r0; r < r1; ++r) {
    float ss = 0.0f;
    for (int64_t i = 0; i < h; ++i) {
      float v = Elem<T>::load(x[r * ldx + i]);
      if (res != nullptr) v = Elem<T>::load(res[r * ldr + i]) + v;
      const T rounded = Elem<T>::store(v);  // summed lives in x's dtype, as the reference's add
      summed[r * h + i] = rounded;
      s[i] = Elem<T>::load(rounded);
      ss += s[i] * s[i];
    }
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) normed[r * h + i] = Elem<T>::store(s[i] * inv * w[i]);
  }
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "add_rms_norm: x must be [T, hidden] with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: weight must be fp32 [hidden]");
  if (residual.has_value())
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->stride(1) == 1 &&
                    residual->scalar_type() == x.scalar_type(),
                "add_rms_norm: residual must be shaped and typed like x");
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor normed = at::empty({rows, h}, x.options());
  at::Tensor summed = at::empty({rows, h}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = static_cast<const T*>(x.data_ptr());
    const T* rp = residual.has_value() ? static_cast<const T*>(residual->data_ptr()) : nullptr;
    const int64_t ldr = residual.has_value() ? residual->stride(0) : 0;
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      add_rms_norm_rows<T>(xp, x.stride(0), rp, ldr, weight.data_ptr<float>(), static_cast<T*>(normed.data_ptr()),
                           static_cast<T*>(summed.data_ptr()), h, static_cast<float>(eps), r0, r1);
    });
  });
  return {normed, summed};
}

// ---- RoPE + KV write -------------------------------------------------------------------
// One head vector [d] rotated: out[i] = x[i] cos[i] - x[i + d/2] sin[i] (i < d/2),
// out[i] = x[i] cos[i] + x[i - d/2] sin[i] (i >= d/2), in fp32.
template <typename T>
inline void rotate(const T* x, const T* cos, const T* sin, int d, float* out) {
  const int half = d / 2;
  for (int i = 0; i < half; ++i) {
    const float a = Elem<T>::load(x[i]), b = Elem<T>::load(x[i + half]);
    out[i] = a * Elem<T>::load(cos[i]) - b * Elem<T>::load(sin[i]);
    out[i + half] = b * Elem<T>::load(cos[i + half]) + a * Elem<T>::load(sin[i + half]);
  }
}

template <typename T, typename C>
void rope_write_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                     const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const int64_t* slots,
                     at::Tensor& q_out, at::Tensor& k_out, int64_t t0, int64_t t1) {
  const int d = static_cast<int>(q.size(2));
  const int64_t hq = q.size(1), hk = k.size(1), bs = k_cache.size(2);
  const T* qp = static_cast<const T*>(q.data_ptr());
  const T* kp = static_cast<const T*>(k.data_ptr());
  const T* vp = static_cast<const T*>(v.data_ptr());
  const T* cp = static_cast<const T*>(cos.data_ptr());
  const T* sp = static_cast<const T*>(sin.data_ptr());
  T* qo = static_cast<T*>(q_out.data_ptr());
  T* ko = static_cast<T*>(k_out.data_ptr());
  C* kc = static_cast<C*>(k_cache.data_ptr());
  C* vc = static_cast<C*>(v_cache.data_ptr());
  std::vector<float> rot(static_cast<size_t>(d));
  for (int64_t t = t0; t < t1; ++t) {
    const T* ct = cp + t * d;
    const T* st = sp + t * d;
    for (int64_t h = 0; h < hq; ++h) {
      rotate<T>(qp + t * q.stride(0) + h * q.stride(1), ct, st, d, rot.data());
      T* dst = qo + (t * hq + h) * d;
      for (int i = 0; i < d; ++i) dst[i] = Elem<T>::store(rot[i]);
    }
    const int64_t slot = slots[t];
    for (int64_t h = 0; h < hk; ++h) {
      rotate<T>(kp + t * k.stride(0) + h * k.stride(1), ct, st, d, rot.data());
      T* dst = ko + (t * hk + h) * d;
      for (int i = 0; i < d; ++i) dst[i] = Elem<T>::store(rot[i]);
      if (slot < 0) continue;
      // The cache holds the rotated key as the query's dtype rounded it, then cast.
      const int64_t at = ((slot / bs) * hk + h) * bs * d + (slot % bs) * d;
      const T* vs = vp + t * v.stride(0) + h * v.stride(1);
      for (int i = 0; i < d; ++i) {
        kc[at + i] = Elem<C>::store(Elem<T>::load(dst[i]));
        vc[at + i] = Elem<C>::store(Elem<T>::load(vs[i]));
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor> rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                                                 at::Tensor v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "rope_write_kv: q, k, v must be [T, heads, head_dim]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "rope_write_kv: head_dim must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rope_write_kv: q [T, Hq, d], k and v [T, Hk, d], d even");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type(),
              "rope_write_kv: q, k, v, cos and sin share one dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == q.size(0) &&
                  cos.size(1) == q.size(2) && sin.sizes() == cos.sizes(),
              "rope_write_kv: cos and sin must be contiguous [T, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "rope_write_kv: caches must be contiguous [blocks, kv_heads, block_size, head_dim], alike");
  TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(3) == k.size(2), "rope_write_kv: k does not fit the cache");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0),
              "rope_write_kv: slot_mapping must be int64 [T]");
  const int64_t tokens = q.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(2);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < capacity, "rope_write_kv: slot ", slots[t], " past the cache (", capacity, " slots)");
  at::Tensor q_out = at::empty({tokens, q.size(1), q.size(2)}, q.options());
  at::Tensor k_out = at::empty({tokens, k.size(1), k.size(2)}, k.options());
  dispatch(q.scalar_type(), [&](auto qtag) {
    using T = decltype(qtag);
    dispatch(k_cache.scalar_type(), [&](auto ctag) {
      using C = decltype(ctag);
      at::parallel_for(0, tokens, 16, [&](int64_t t0, int64_t t1) {
        rope_write_rows<T, C>(q, k, v, cos, sin, k_cache, v_cache, slots, q_out, k_out, t0, t1);
      });
    });
  });
  return {q_out, k_out};
}

// ---- gated activation ------------------------------------------------------------------
template <typename T>
void gated_rows(const T* y, int64_t ldy, int64_t inter, Act act, T* out, int64_t r0, int64_t r1) {
  float g[kLanes] = {}, u[kLanes] = {};
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = y + r * ldy;
    const T* up = gate + inter;
    T* dst = out + r * inter;
    int64_t i = 0;
    for (; i + kLanes <= inter; i += kLanes) vstore(dst + i, activate(vload(gate + i), vload(up + i), act));
    if (i == inter) continue;
    const int64_t n = inter - i;  // the tail through a vector's worth of scratch
    for (int64_t j = 0; j < n; ++j) g[j] = Elem<T>::load(gate[i + j]), u[j] = Elem<T>::load(up[i + j]);
    float o[kLanes];
    vstore(o, activate(vload(g), vload(u), act));
    for (int64_t j = 0; j < n; ++j) dst[i + j] = Elem<T>::store(o[j]);
  }
}

at::Tensor gated_act(const at::Tensor& y, c10::string_view activation) {
  TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.size(1) % 2 == 0,
              "gated_act: y must be [T, 2 x intermediate] with contiguous rows");
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "gated_act: activation must be silu or gelu_tanh");
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16, "gated_act: y must be fp32 or bf16");
  const Act act = activation == "silu" ? Act::kSilu : Act::kGeluTanh;
  const int64_t rows = y.size(0), inter = y.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, y.options());
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    // The work pool's threads, as the projection before it had (an element costs about
    // what 8 weights of a quantized multiply do).
    share_items(rows, 8 * inter, [&](int64_t r0, int64_t r1) {
      gated_rows<T>(static_cast<const T*>(y.data_ptr()), y.stride(0), inter, act, static_cast<T*>(out.data_ptr()), r0,
                    r1);
    });
  };
  y.scalar_type() == at::kFloat ? run(float{}) : run(uint16_t{});
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rope_write_kv(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> (Tensor, Tensor)");
  m.def("gated_act(Tensor y, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("gated_act", &gated_act);
}
