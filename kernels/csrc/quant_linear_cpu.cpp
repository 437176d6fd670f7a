// Linear layers over GGUF's quantized blocks, read as the file has them: y = x @ W.T for
// W [N, K] stored row by row in blocks (kernels/gguf_quant.py: the formats, and the
// torch reference this kernel is tested against).
//
// A pass decodes kRows output rows of W into fp32 (a few KB: L1) and multiplies them by
// a chunk of up to kMChunk rows of x, kRows vector accumulators per row of x, each x
// vector load feeding kRows FMAs; the accumulators are summed across lanes once per
// output. The weights are read once per chunk of x rows: a decode step (one to a few
// rows) reads each block once, and its time is the blocks' read plus their decode,
// which is what makes the quantized bytes worth it (Q4_1: 20 bytes per 32 weights
// where fp32 reads 128). The threads share the output rows out (work_pool.h: at a
// decode's small step, the caller and the pool's helpers take chunks as they come).
//
// The decoded weights are the reference's bit for bit (gguf_decode_fp32.h: how; a test
// multiplies by the identity).
// The products with x are summed in a different order than torch's matmul: the result
// is the reference's within fp32 rounding.
//
// The vectors are cpu_vec.h's vfloat, as wide as the build's ISA (8 lanes with AVX2,
// 16 with AVX-512): nothing here is specific to either.
//
// Where the build has AVX2, FMA and F16C, every format takes quant_fused_avx2.h's path
// (the 32-weight formats) or quant_kquant_avx2.h's (Q4_K, Q5_K, Q6_K) instead: at a
// decode's few rows of x the blocks go from their bytes into the products in registers,
// never written out (the path above decoded a Q4_1 step slower than fp32 read its
// weights: 51.1 vs 46.1 ms); at more rows they are decoded once per panel of weight
// rows (sized for L2) and multiplied by a 3 x 4 dot-product tile, and from kPackedFrom
// rows also packed 16 columns wide for panel_gemm_avx2.h's broadcast tile.
//
// bf16 x from kPackedFrom rows, where the build has AVX512-BF16: the decoded panels are
// rounded to bf16 and multiplied by vdpbf16ps (panel_gemm_bf16.h), the reference's
// product (`.to(x.dtype)`: the bf16 checkpoint's weights) at twice the pairs per
// instruction. Below that, and without the instruction, bf16 x multiplies the fp32
// decoded weights (within bf16 rounding of the reference). quant_linear_bf16_rows()
// says which.
//
// Op (torch.ops.pagedserve_cpu): quant_linear(x, data, qtype, out_features) -> y;
// x [M, K] fp32 or bf16 with contiguous rows, data uint8 [N, K / block * block_bytes],
// y [M, N] in x's dtype, rounded once from the fp32 sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"
#include "gguf_decode_fp32.h"
#include "gguf_formats.h"
#include "quant_linear_cpu.h"
#include "work_pool.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_FUSED_QUANT 1
#include "panel_gemm_avx2.h"
#include "quant_kquant_avx2.h"
#if defined(__AVX512BF16__)
#define PAGEDSERVE_BF16_PANELS 1
#include "panel_gemm_bf16.h"
#endif
#endif

namespace {

using namespace pagedserve_cpu;

constexpr int kRows = 4;           // output rows decoded and multiplied together
constexpr int64_t kMChunk = 64;    // rows of x per sweep over the weights (they stay in L2)

inline float hsum(vfloat v) {
  float lanes[kLanes];
  vstore(lanes, v);
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

template <typename T>
void store(T* y, float v) {
  if constexpr (std::is_same_v<T, float>)
    *y = v;
  else
    *y = float_to_bf16_bits(v);
}

// y[m0:m1, n0:n0+rows] from the decoded rows w [kRows][K] (rows of them this group's; the
// rest finite, their sums dropped) and x (fp32 [M, K]). Every group sums all kRows rows:
// loops bounded by `rows` were compiled (and, reassociated, summed) apart for a last
// partial group, so an output's bits depended on the group it fell in.
template <typename T>
void multiply(const float* w, int rows, const float* x, int64_t K, int64_t m0, int64_t m1, T* y, int64_t N,
              int64_t n0) {
  for (int64_t m = m0; m < m1; ++m) {
    const float* xm = x + m * K;
    vfloat acc[kRows] = {};
    for (int64_t k = 0; k < K; k += kLanes) {
      const vfloat xv = vload(xm + k);
      for (int r = 0; r < kRows; ++r) acc[r] += xv * vload(w + r * K + k);
    }
    float sums[kRows];
    for (int r = 0; r < kRows; ++r) sums[r] = hsum(acc[r]);
    for (int r = 0; r < rows; ++r) store(y + m * N + n0 + r, sums[r]);
  }
}

#ifdef PAGEDSERVE_FUSED_QUANT
// y[m0:m0+MR, n0:n0+NR] through one fused tile, rounded once to y's dtype.
template <Format F, int MR, int NR, typename T>
void fused_tile(const uint8_t* data, int64_t row_bytes, int64_t K, const float* xs, const float* sums, int64_t m0,
                int64_t n0, T* y, int64_t N) {
  float out[MR * NR];
  fused::tile<F, MR, NR>(data + n0 * row_bytes, row_bytes, K, xs + m0 * K, sums + m0 * (K / 4), out, NR);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) store(y + (m0 + r) * N + n0 + n, out[r * NR + n]);
}

// y[m0:m0+MR, n0:n0+NR] from the decoded rows w (from row n0 on), rounded once.
template <int MR, int NR, typename T>
void dense_tile(const float* w, int64_t K, const float* xs, int64_t m0, int64_t n0, T* y, int64_t N) {
  float out[MR * NR];
  fused::dense_tile<MR, NR>(w, K, xs + m0 * K, out, NR);
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NR; ++n) store(y + (m0 + r) * N + n0 + n, out[r * NR + n]);
}

// The output rows split over the threads in groups of kFusedNR; each group's weight rows
// (a few hundred bytes each) stay in L1 while the rows of x pass under them, so the
// weights are read from memory once per step. A few rows of x (a decode) multiply the
// blocks as they are decoded in registers; more (a batch, a prefill) first decode a
// panel of groups into fp32 once and then run a GEMM tile over it (run_fused_batch).
constexpr int kFusedNR = 4;
constexpr int kFusedMR = 2;
// A batch's tile: 3 x 4 accumulators, the 4 weight vectors and an x vector fill AVX2's 16
// registers (4 x 2 loaded more per FMA: 1.25x the time; 4 x 4 spills).
constexpr int kBatchMR = 3;
constexpr int64_t kBatchFrom = 4;  // rows of x from which decoding once beats decoding per pair of rows
// Rows of x from which packing pays; against the dot-product tile, one thread, Q4_1
// 576 x 1536: 0.7x at 4 rows, 1.0x at 8, 1.0-1.3x at 16, 1.2-1.3x at 32.
constexpr int64_t kPackedFrom = 16;

template <Format F, typename T>
void run_fused_rows(const float* xs, int64_t M, int64_t K, const uint8_t* data, int64_t N, T* y) {
  std::vector<float> sums(fused::needs_sums<F>() ? static_cast<size_t>(M * K / 4) : 0);
  if (fused::needs_sums<F>()) fused::block_sums(xs, M, K, sums.data());
  const int64_t row_bytes = pagedserve_cpu::row_bytes<F>(K);
  share_items((N + kFusedNR - 1) / kFusedNR, kFusedNR * K * M, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kFusedNR;
      const bool whole = n0 + kFusedNR <= N;
      int64_t m = 0;
      for (; m + kFusedMR <= M; m += kFusedMR) {
        if (whole)
          fused_tile<F, kFusedMR, kFusedNR>(data, row_bytes, K, xs, sums.data(), m, n0, y, N);
        else
          for (int64_t n = n0; n < N; ++n) fused_tile<F, kFusedMR, 1>(data, row_bytes, K, xs, sums.data(), m, n, y, N);
      }
      for (; m < M; ++m) {
        if (whole)
          fused_tile<F, 1, kFusedNR>(data, row_bytes, K, xs, sums.data(), m, n0, y, N);
        else
          for (int64_t n = n0; n < N; ++n) fused_tile<F, 1, 1>(data, row_bytes, K, xs, sums.data(), m, n, y, N);
      }
    }
  });
}

// y[m0:m0+MR, n_first:n_end] from a panel's decoded rows w (row n_first first).
template <int MR, typename T>
void panel_tile(const float* w, int64_t K, const float* xs, int64_t m0, int64_t n_first, int64_t n_end, T* y,
                int64_t N) {
  int64_t n0 = n_first;
  for (; n0 + kFusedNR <= n_end; n0 += kFusedNR) dense_tile<MR, kFusedNR>(w + (n0 - n_first) * K, K, xs, m0, n0, y, N);
  for (; n0 < n_end; ++n0) dense_tile<MR, 1>(w + (n0 - n_first) * K, K, xs, m0, n0, y, N);
}

// y[:, n_first:n_end]: kBatchMR rows of x at a time (they stay in L1) under the whole panel.
template <typename T>
void panel_rows(const float* w, int64_t K, const float* xs, int64_t M, int64_t n_first, int64_t n_end, T* y,
                int64_t N) {
  int64_t m = 0;
  for (; m + kBatchMR <= M; m += kBatchMR) panel_tile<kBatchMR>(w, K, xs, m, n_first, n_end, y, N);
  if (M - m == 2) panel_tile<2>(w, K, xs, m, n_first, n_end, y, N);
  if (M - m == 1) panel_tile<1>(w, K, xs, m, n_first, n_end, y, N);
}

// A batch decodes a panel of weight rows into fp32 once, sized to stay in L2, and passes
// every row of x under it. Before, x (a prefill's is megabytes) passed under each group
// of 4 rows, so it was read from L3 once per 4 output columns: ~90 GFLOP/s against MKL's
// ~140 on two AVX2 cores. Each output is still one dense_tile's sum, so the same bits.
constexpr int64_t kPanelBytes = 256 * 1024;
constexpr int64_t kPanelsPerThread = 4;  // enough panels that two threads end together

// Groups of `group_floats` decoded weights per panel, out of `groups`.
int64_t panel_groups(int64_t group_floats, int64_t groups) {
  const int64_t fit = std::max<int64_t>(1, kPanelBytes / (group_floats * static_cast<int64_t>(sizeof(float))));
  const int64_t spread = std::max<int64_t>(1, groups / (kPanelsPerThread * 2));
  return std::min(fit, spread);
}

template <Format F, typename T>
void run_fused_batch(const float* xs, int64_t M, int64_t K, const uint8_t* data, int64_t N, T* y) {
  const int64_t row_bytes = pagedserve_cpu::row_bytes<F>(K);
  const int64_t groups = (N + kFusedNR - 1) / kFusedNR;
  const int64_t panel_rows_n = panel_groups(kFusedNR * K, groups) * kFusedNR;
  const int64_t panels = (N + panel_rows_n - 1) / panel_rows_n;
  share_items(panels, panel_rows_n * K * M, [&](int64_t p0, int64_t p1) {
    std::vector<float> w(static_cast<size_t>(panel_rows_n * K));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n_first = p * panel_rows_n, n_end = std::min(N, n_first + panel_rows_n);
      fused::decode_rows<F>(data + n_first * row_bytes, row_bytes, static_cast<int>(n_end - n_first), K, w.data());
      panel_rows(w.data(), K, xs, M, n_first, n_end, y, N);
    }
  });
}

// A larger batch: panel_gemm_avx2.h's packed tiles (Kernel: panel::Fp32, or bf16's) over
// panels of Kernel::kCols-row groups; x's rows ldx apart.
template <typename Kernel, Format F, typename T>
void run_fused_packed(const typename Kernel::X* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* data, int64_t N,
                      T* y) {
  const int64_t row_bytes = pagedserve_cpu::row_bytes<F>(K);
  const int64_t groups = (N + Kernel::kCols - 1) / Kernel::kCols;
  const int64_t per_panel = panel_groups(Kernel::kCols * K, groups);
  const auto decode = [&](int64_t n0, int n, float* out) {
    fused::decode_rows<F>(data + n0 * row_bytes, row_bytes, n, K, out);
  };
  const auto put = [&](int64_t m, int64_t n, float v) { store(y + m * N + n, v); };
  share_items((groups + per_panel - 1) / per_panel, per_panel * Kernel::kCols * K * M, [&](int64_t p0, int64_t p1) {
    panel::Buffers<Kernel> buffers(per_panel, K);
    for (int64_t p = p0; p < p1; ++p)
      panel::multiply<Kernel>(x, ldx, M, K, N, p * per_panel, std::min(groups, (p + 1) * per_panel), buffers, decode,
                              put);
  });
}

template <Format F, typename T>
void run_fused(const float* xs, int64_t M, int64_t K, const uint8_t* data, int64_t N, T* y) {
  if (M < kBatchFrom)
    run_fused_rows<F>(xs, M, K, data, N, y);
  else if (M < kPackedFrom)
    run_fused_batch<F>(xs, M, K, data, N, y);
  else
    run_fused_packed<panel::Fp32, F>(xs, K, M, K, data, N, y);
}
#endif

template <Format F, typename T>
void run(const T* x, int64_t ldx, int64_t M, int64_t K, const FormatInfo& fi, const uint8_t* data, int64_t N,
         T* y) {
#ifdef PAGEDSERVE_BF16_PANELS
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (M >= kPackedFrom) return run_fused_packed<panel_bf16::Kernel, F>(x, ldx, M, K, data, N, y);
  }
#endif
  // x as fp32 rows of exactly K (copied where it is bf16 or strided: M x K is small
  // beside the weights).
  std::vector<float> copy;
  const float* xs = reinterpret_cast<const float*>(x);
  if (!std::is_same_v<T, float> || ldx != K) {
    copy.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        if constexpr (std::is_same_v<T, float>)
          copy[m * K + k] = x[m * ldx + k];
        else
          copy[m * K + k] = bf16_to_float(x[m * ldx + k]);
      }
    xs = copy.data();
  }
#ifdef PAGEDSERVE_FUSED_QUANT
  run_fused<F>(xs, M, K, data, N, y);
#else
  const int64_t row_bytes = K / fi.elems * fi.bytes;
  const int64_t groups = (N + kRows - 1) / kRows;
  for (int64_t m0 = 0; m0 < M; m0 += kMChunk) {
    const int64_t m1 = std::min(M, m0 + kMChunk);
    share_items(groups, kRows * K * (m1 - m0), [&](int64_t g0, int64_t g1) {
      std::vector<float> w(static_cast<size_t>(kRows * K));
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kRows;
        const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n0));
        decode_rows<F>(fi, data, row_bytes, n0, rows, K, w.data());
        multiply(w.data(), rows, xs, K, m0, m1, y, N, n0);
      }
    });
  }
#endif
}

}  // namespace

namespace pagedserve_cpu {

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& data, c10::string_view qtype, int64_t out_features) {
  const FormatInfo fi = checked_format(x, data, qtype, out_features, "quant_linear");
  const int64_t K = x.size(1);
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
  const uint8_t* d = data.data_ptr<uint8_t>();
  const auto go = [&](auto format) {
    constexpr Format F = decltype(format)::value;
    if (x.scalar_type() == at::kFloat)
      run<F>(x.data_ptr<float>(), x.stride(0), x.size(0), K, fi, d, out_features, y.data_ptr<float>());
    else
      run<F>(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), x.size(0), K, fi, d, out_features,
             reinterpret_cast<uint16_t*>(y.data_ptr()));
  };
  dispatch(fi.format, go);
  return y;
}

// The rows of bf16 x from which quant_linear multiplies the weights rounded to bf16 (0:
// never, in this build).
int64_t quant_linear_bf16_rows() {
#ifdef PAGEDSERVE_BF16_PANELS
  return kPackedFrom;
#else
  return 0;
#endif
}

}  // namespace pagedserve_cpu

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor data, str qtype, int out_features) -> Tensor");
  m.def("quant_linear_bf16_rows() -> int", &pagedserve_cpu::quant_linear_bf16_rows);
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("quant_linear", &pagedserve_cpu::quant_linear); }
