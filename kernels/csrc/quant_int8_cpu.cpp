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
// (bench/results/cpu_gguf_step.md: how far).
//
// Where the build has AVX2, FMA and F16C, every format runs quant_int8_panel.h's panel
// GEMM: over a weight packed at load (pack_int8: the worker packs every one but a tied
// head), or over groups of rows repacked per call (from kPanelFrom rows of x; at any rows
// but Q8_0's and Q4's, whose fewer rows of the file's layout run quant_int8_avx2.h's tiles
// over the blocks as they are). On a build without AVX2 every format decodes a group of
// weight rows into int8 quants with a scale and an offset per 16 weights
// (gguf_decode_int8.h), then multiplies them by every row of x with plain loops the compiler vectorizes (run_generic), below
// kScaledFrom rows.
//
// Ops (torch.ops.pagedserve_cpu): quant_linear_int8(x, data, qtype, out_features) -> y;
// x [M, K] fp32 or bf16 with contiguous rows, data uint8 [N, K / block * block_bytes],
// y [M, N] in x's dtype, rounded once from the fp32 sums; qtype a GGUF type's name, or a
// packed layout's ("Q8_0x16": the format and the panels' lanes). int8_pack_lanes(qtype)
// -> the lanes this build packs the format into (0: not packed); pack_int8(data, qtype)
// -> data packed, the same shape (kernels/quant_cpu_ops.py's Int8Panels: the layout).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "gguf_decode_int8.h"
#include "gguf_formats.h"
#include "quant_linear_cpu.h"
#include "work_pool.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_INT8_AVX2 1
#include "quant_int8_avx2.h"
#include "quant_int8_panel.h"
#endif
#include "quant_int8_x.h"

namespace {

using namespace pagedserve_cpu;

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
// The formats quant_int8_avx2.h's tiles take (the panels take every one).
template <Format F>
constexpr bool tile_format() {
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

// The panel GEMM (quant_int8_panel.h): the output rows shared out over the threads a
// group of int8_panel::kLanes at a time. Each group is a panel packed at load (pack_int8), or
// is repacked here once and serves every row of x, kMR rows at a time: from kPanelFrom
// rows of x, where that beats the tiles.
constexpr int kMR = int8_panel::kLanes == 16 ? 8 : 4;  // x's rows per pass: what the registers hold

template <Format F, int MR, typename T>
void panel_rows(const uint8_t* pan, bool streamed, const QuantizedX& x, int64_t m, int64_t n0, int rows, T* y,
                int64_t N) {
  constexpr int L = int8_panel::kLanes;
  const int64_t blocks = x.K / 32;
  alignas(64) float out[MR * L];
  int8_panel::multiply<F, MR>(pan, streamed, blocks, x.K, x.q.data() + m * x.K, x.d.data() + m * blocks,
                         x.ds.data() + m * blocks, x.sum32.data() + m * blocks, x.sum16.data() + 2 * m * blocks, out);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < rows; ++n) store(y + (m + r) * N + n0 + n, out[r * L + n]);
}

// packed: the data's full groups are panels (pack_int8); a last partial group is as the
// file has it.
template <Format F, typename T>
void run_panel(const QuantizedX& x, const uint8_t* data, int64_t N, bool packed, T* y) {
  constexpr int L = int8_panel::kLanes;
  const int64_t file_blocks = x.K / block_elems<F>(), row_bytes = pagedserve_cpu::row_bytes<F>(x.K);
  share_items((N + L - 1) / L, L * x.K * x.M, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> buffer;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * L;
      const int rows = static_cast<int>(std::min<int64_t>(L, N - n0));
      const bool streamed = packed && rows == L;
      const uint8_t* pan = data + n0 * row_bytes;
      if (!streamed) {
        buffer.resize(file_blocks * int8_panel::block_stride<F>());
        int8_panel::repack<F>(data, row_bytes, file_blocks, n0, rows, buffer.data());
        pan = buffer.data();
      }
      int64_t m = 0;
      for (; m + kMR <= x.M; m += kMR) panel_rows<F, kMR>(pan, streamed, x, m, n0, rows, y, N);
      for (; m < x.M; ++m) panel_rows<F, 1>(pan, streamed, x, m, n0, rows, y, N);
    }
  });
}

// The weight with its full groups of int8_panel::kLanes rows packed into panels, in as many
// bytes; the rows after them as they are.
template <Format F>
at::Tensor pack_groups(const at::Tensor& data, int64_t N, int64_t K) {
  constexpr int L = int8_panel::kLanes;
  const int64_t blocks = K / block_elems<F>(), row_bytes = pagedserve_cpu::row_bytes<F>(K);
  at::Tensor out = data.clone();
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  share_items(N / L, L * K, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) int8_panel::repack<F>(src, row_bytes, blocks, g * L, L, dst + g * L * row_bytes);
  });
  return out;
}
#endif

// The rows of x from which the file's layout is repacked into panels per call (where the
// build has them): below, the tiles read it as it is. Outside the AVX2 code so that a build
// without AVX2 compiles (there it never applies).
constexpr int64_t kPanelFrom = 4;

// From kScaledFrom rows of x on a build without panels (no AVX2), x's quants are scaled
// back to fp32 (d * q, rounded once) and multiplied by the fp32 path's packed tiles, where
// the decode is paid once per panel: the same x's quants and scales, so the same product
// up to fp32 rounding, the bound the tests hold both to.
constexpr int64_t kScaledFrom = 16;

// A packed weight's qtype names its layout: the file's format and the panels' lanes
// ("Q8_0x16"), so a weight packed by one build is refused by another.
struct Layout {
  std::string format;
  bool packed;
};

Layout layout_of(c10::string_view qtype) {
  std::string name(qtype);
#ifdef PAGEDSERVE_INT8_AVX2
  const std::string suffix = "x" + std::to_string(int8_panel::kLanes);
  if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
    return {name.substr(0, name.size() - suffix.size()), true};
#endif
  return {name, false};
}

// The panels' lanes where this build has the panel GEMM (every format), else 0.
int64_t panel_lanes() {
#ifdef PAGEDSERVE_INT8_AVX2
  return int8_panel::kLanes;
#else
  return 0;
#endif
}

// Whether quant_int8_avx2.h's tiles take `format` in this build (below kPanelFrom rows of
// the file's layout; the other panel formats are repacked per call at any rows).
bool tiles_take(const FormatInfo& fi) {
  bool tiles = false;
#ifdef PAGEDSERVE_INT8_AVX2
  dispatch(fi.format, [&](auto format) { tiles = tile_format<decltype(format)::value>(); });
#endif
  return tiles;
}

at::Tensor quant_linear_int8(const at::Tensor& x, const at::Tensor& data, c10::string_view qtype,
                             int64_t out_features) {
  const Layout layout = layout_of(qtype);
  const FormatInfo fi = checked_format(x, data, layout.format, out_features, "quant_linear_int8");
  const int64_t M = x.size(0), K = x.size(1);
  const bool panels = panel_lanes() > 0;
  TORCH_CHECK(!layout.packed || panels, "quant_linear_int8: ", layout.format, " is not packed here");
  const bool by_panel = panels && (layout.packed || M >= kPanelFrom || !tiles_take(fi));
  if (M >= kScaledFrom && !by_panel) {
    const at::Tensor x_hat =
        x.scalar_type() == at::kFloat
            ? scaled_back(x.data_ptr<float>(), x.stride(0), M, K)
            : scaled_back(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), M, K);
    return quant_linear(x_hat, data, qtype, out_features).to(x.scalar_type());
  }
  at::Tensor y = at::empty({M, out_features}, x.options());
  if (M == 0 || out_features == 0) return y;
  const uint8_t* d = data.data_ptr<uint8_t>();
  const auto go = [&](auto format) {
    constexpr Format F = decltype(format)::value;
    const auto with = [&](auto* xp, auto* yp) {
      const QuantizedX xq = quantize_x(xp, x.stride(0), M, K);
#ifdef PAGEDSERVE_INT8_AVX2
      if (by_panel) return run_panel<F>(xq, d, out_features, layout.packed, yp);
      if constexpr (tile_format<F>()) return run_avx2<F>(xq, d, out_features, yp);
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

int64_t int8_pack_lanes(c10::string_view qtype) {
  const std::string name(qtype);
  format_of(name, "int8_pack_lanes");  // refuses a format not decoded here
  return panel_lanes();
}

// data [N, K / 32 * block_bytes] as the file has it -> the same bytes packed for
// quant_linear_int8 under the qtype "<qtype>x<int8_pack_lanes(qtype)>".
at::Tensor pack_int8(const at::Tensor& data, c10::string_view qtype) {
  const FormatInfo fi = format_of(std::string(qtype), "pack_int8");
  TORCH_CHECK(panel_lanes() > 0, "pack_int8: ", std::string(qtype), " is not packed here");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.dim() == 2 &&
                  data.size(1) % fi.bytes == 0,
              "pack_int8: data must be uint8 [N, K / ", fi.elems, " * ", fi.bytes, "]");
  at::Tensor out;
#ifdef PAGEDSERVE_INT8_AVX2
  dispatch(fi.format, [&](auto format) {
    constexpr Format F = decltype(format)::value;
    out = pack_groups<F>(data, data.size(0), data.size(1) / fi.bytes * fi.elems);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_linear_int8(Tensor x, Tensor data, str qtype, int out_features) -> Tensor");
  m.def("int8_pack_lanes(str qtype) -> int", &int8_pack_lanes);
  m.def("pack_int8(Tensor data, str qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("quant_linear_int8", &quant_linear_int8);
  m.impl("pack_int8", &pack_int8);
}
