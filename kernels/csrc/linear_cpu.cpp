// Linear layers for the CPU: y = x @ W.T over weights packed once, at load, into the
// layout this kernel streams (pack_linear), for batches from one row (a decode step of
// one stream) to thousands (a prefill).
//
// Layout: the output columns in blocks of kBlock = 4 vectors (64 columns with AVX-512);
// a block holds, for each k (each pair of k with bf16 dot products), the 4 vectors of
// its columns' weights, so a block is one contiguous run and the whole matrix one
// sequential stream. A pass multiplies one block by a group of up to kMR activation
// rows: kMR x 4 accumulators, each holding a vector of output columns, fed by
// broadcasts of x, with no horizontal sums and every output's products summed in k
// order (the same sums whatever the batch, and whatever the thread count: each thread
// owns whole blocks). A decode step's time is the weights' read; the layout makes that
// read one stream the hardware prefetcher follows, with a software prefetch a few
// blocks ahead.
//
// A short batch (a speculative verification chunk: 5 rows for 4 drafts) must cost
// about one row's read of the weights, not one per group of rows: the rows are split
// into groups as even as kMR allows (5 rows: one group; 8: two of 4), and with more
// than one group a block is walked in chunks of k small enough to stay in L1 while
// every group multiplies it, each group's accumulators parked in memory between
// chunks (exact: fp32 stored and reloaded). Before, 5 rows took a pass of 4 and a
// second pass of 1 over every block, 1.7x one row's time (bench/results/cpu_verify_step.md).
//
// bf16 weights use the CPU's bf16 dot-product instruction where it has one
// (AVX512-BF16 vdpbf16ps: two exact products per fp32 lane, fp32 sums); elsewhere
// they are widened to fp32 by a shift (exact) and multiplied with fp32 FMAs at the
// build's vector width. fp32 weights use fp32 FMAs.
//
// Gated (the fused gate-up projection of a gated MLP, W = [gate; up]): a block holds
// two vectors of gate columns and the same two of up columns, and the output is
// act(x @ gate.T) * (x @ up.T): the [M, 2I] intermediate is never written.
//
// Ops (torch.ops.pagedserve_cpu): pack_linear(W, gated) -> packed; linear(x, packed,
// out_features, in_features, activation) -> y, activation "" (plain), "silu" or
// "gelu_tanh" (gated). x and W of one dtype, fp32 or bf16; the result rounded once
// from the fp32 sums to that dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_vec.h"
#include "linear_cpu.h"
#include "work_pool.h"

namespace {

using namespace pagedserve_cpu;

constexpr int kVecs = 4;                  // vectors of output columns per block
constexpr int kBlock = kVecs * kLanes;    // output columns per block (per half when gated)
// Activation rows per group: kMR x kVecs accumulators, the block's kVecs weight vectors
// and a broadcast must fit the registers (32 with AVX-512: 6 x 4 + 4 + 1).
#if defined(__AVX512F__)
constexpr int kMR = 6;
#else
constexpr int kMR = 4;
#endif
constexpr int64_t kMacroRows = 256;       // rows of x per sweep over the weights (x stays in L2)
constexpr int kPrefetchBlocks = 2;        // software prefetch distance into L2, in blocks
constexpr int kNearSteps = 16;            // and into L1, in k-steps
constexpr int64_t kChunkBytes = 16 << 10; // a block's k-chunk that every group multiplies from L1

#if defined(__AVX512BF16__)
constexpr bool kNativeBf16 = true;
#else
constexpr bool kNativeBf16 = false;
#endif

// k per step of the packed layout: pairs for the bf16 dot product, else single.
template <typename T>
constexpr int k_step() {
  return std::is_same_v<T, uint16_t> && kNativeBf16 ? 2 : 1;
}

struct Shape {
  int64_t N, K;  // output columns (per half when gated), input features
  bool gated;
  int64_t padded_k(int step) const { return (K + step - 1) / step * step; }
  int64_t blocks() const { return (N + (gated ? kBlock / 2 : kBlock) - 1) / (gated ? kBlock / 2 : kBlock); }
};

// Packed element index of weight row `row`, feature k: block, k step, vector, lane, pair.
template <typename T>
void pack(const T* w, const Shape& s, T* out) {
  constexpr int step = k_step<T>();
  const int64_t kp = s.padded_k(step);
  const int cols = s.gated ? kBlock / 2 : kBlock;  // output columns per block
  const int64_t block_elems = kp * kBlock;
  std::fill(out, out + s.blocks() * block_elems, T{});
  for (int64_t b = 0; b < s.blocks(); ++b)
    for (int v = 0; v < kVecs; ++v)
      for (int lane = 0; lane < kLanes; ++lane) {
        // Gated: vectors 0, 1 hold gate columns, 2, 3 the same up columns.
        const int c = s.gated ? (v % (kVecs / 2)) * kLanes + lane : v * kLanes + lane;
        const int64_t col = b * cols + c;
        if (col >= s.N) continue;
        const int64_t row = s.gated && v >= kVecs / 2 ? s.N + col : col;
        for (int64_t k = 0; k < s.K; ++k)
          out[b * block_elems + (k / step) * kBlock * step + (v * kLanes + lane) * step + k % step] =
              w[row * s.K + k];
      }
}

// Every cache line of the k-step at wk `ahead` elements on (into L2: the stream of the
// blocks to come) and kNearSteps on (into L1). Fetching 2 of a k-step's 4 lines (the
// hardware prefetcher left to find the rest) left a pass over 5 rows 1.3x one row's
// time; all of them: 1.05x, the multiplies hidden under the read (SmolLM2-135M's
// layers, bf16, one thread of the 2-core EPYC).
template <typename T, int Step>
inline void prefetch_step(const T* wk, int64_t ahead) {
  constexpr int bytes = kBlock * Step * static_cast<int>(sizeof(T));
  const char* far = reinterpret_cast<const char*>(wk + ahead);
  const char* near = reinterpret_cast<const char*>(wk + kNearSteps * Step * kBlock);
  for (int off = 0; off < bytes; off += 64) {
    __builtin_prefetch(far + off, 0, 2);
    __builtin_prefetch(near + off);
  }
}

// ---- the micro-kernels: `steps` k-steps of one block x MR rows, into acc[MR][kVecs] ----
// w: the block's first k-step to read; x[m]: row m's features at that k-step; `ahead`:
// elements to the same k-step of the block kPrefetchBlocks on, 0 where w is in L1
// already (nothing prefetched).
template <typename T, int MR>
inline void block_fma(const T* w, const float* const* x, int64_t steps, int64_t ahead, vfloat acc[kMR][kVecs]) {
  vfloat a[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) a[m][v] = acc[m][v];
  for (int64_t k = 0; k < steps; ++k) {
    const T* wk = w + k * kBlock;
    if (ahead) prefetch_step<T, 1>(wk, ahead);
    vfloat wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = vload(wk + v * kLanes);
    for (int m = 0; m < MR; ++m) {
      const float xm = x[m][k];
      for (int v = 0; v < kVecs; ++v) a[m][v] += wv[v] * xm;
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) acc[m][v] = a[m][v];
}

#if defined(__AVX512BF16__)
template <int MR>
inline void block_dpbf16(const uint16_t* w, const uint16_t* const* x, int64_t steps, int64_t ahead,
                         vfloat acc[kMR][kVecs]) {
  __m512 a[MR][kVecs];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) std::memcpy(&a[m][v], &acc[m][v], sizeof(vfloat));
  for (int64_t kp = 0; kp < steps; ++kp) {
    const uint16_t* wk = w + kp * 2 * kBlock;
    if (ahead) prefetch_step<uint16_t, 2>(wk, ahead);
    __m512bh wv[kVecs];
    for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(wk + v * 32);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x[m] + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kVecs; ++v) a[m][v] = _mm512_dpbf16_ps(a[m][v], wv[v], xb);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVecs; ++v) std::memcpy(&acc[m][v], &a[m][v], sizeof(vfloat));
}
#endif

// One group of mr rows (XF: how the micro-kernel reads x) through `steps` k-steps.
template <typename T, typename XF, int MR>
inline void group_steps(const T* w, const XF* const* x, int64_t steps, int64_t ahead, vfloat acc[kMR][kVecs]) {
  if constexpr (std::is_same_v<XF, uint16_t>) {
#if defined(__AVX512BF16__)
    block_dpbf16<MR>(w, x, steps, ahead, acc);
#endif
  } else {
    block_fma<T, MR>(w, x, steps, ahead, acc);
  }
}

template <typename T, typename XF>
void group_dispatch(int mr, const T* w, const XF* const* x, int64_t steps, int64_t ahead, vfloat acc[kMR][kVecs]) {
  switch (mr) {
    case 1: group_steps<T, XF, 1>(w, x, steps, ahead, acc); break;
    case 2: group_steps<T, XF, 2>(w, x, steps, ahead, acc); break;
    case 3: group_steps<T, XF, 3>(w, x, steps, ahead, acc); break;
#if defined(__AVX512F__)
    case 4: group_steps<T, XF, 4>(w, x, steps, ahead, acc); break;
    case 5: group_steps<T, XF, 5>(w, x, steps, ahead, acc); break;
    default: group_steps<T, XF, 6>(w, x, steps, ahead, acc); break;
#else
    default: group_steps<T, XF, 4>(w, x, steps, ahead, acc); break;
#endif
  }
}

struct Problem {
  const void* x;  // [M, K], row stride ldx
  int64_t ldx;
  const void* packed;
  void* y;  // [M, N]
  int64_t M;
  Shape shape;
  Act act;
};

template <typename T>
inline void store_row(T* dst, vfloat v, int n) {  // the first n lanes
  if (n == kLanes) {
    vstore(dst, v);
    return;
  }
  float tmp[kLanes];
  vstore(tmp, v);
  for (int i = 0; i < n; ++i) dst[i] = std::is_same_v<T, float> ? tmp[i] : float_to_bf16_bits(tmp[i]);
}

// Row group g of the rows [0, rows): `groups` groups as even as can be, the first
// rows % groups of them one row longer.
struct RowGroups {
  int64_t rows, groups;
  explicit RowGroups(int64_t rows) : rows(rows), groups((rows + kMR - 1) / kMR) {}
  int64_t start(int64_t g) const { return g * (rows / groups) + std::min(g, rows % groups); }
  int size(int64_t g) const { return static_cast<int>(rows / groups + (g < rows % groups ? 1 : 0)); }
};

// The group's accumulators [i][v] into rows `out` (row stride N) from column n0 on.
template <typename T>
void store_group(const Problem& p, vfloat acc[kMR][kVecs], int mr, T* out, int64_t n0) {
  const Shape& s = p.shape;
  for (int i = 0; i < mr; ++i, out += s.N) {
    if (s.gated) {
      for (int v = 0; v < kVecs / 2; ++v) {
        const int64_t c = static_cast<int64_t>(v) * kLanes;
        if (n0 + c < s.N)
          store_row(out + n0 + c, activate(acc[i][v], acc[i][v + kVecs / 2], p.act),
                    static_cast<int>(std::min<int64_t>(kLanes, s.N - n0 - c)));
      }
    } else {
      for (int v = 0; v < kVecs; ++v) {
        const int64_t c = static_cast<int64_t>(v) * kLanes;
        if (n0 + c < s.N) store_row(out + n0 + c, acc[i][v], static_cast<int>(std::min<int64_t>(kLanes, s.N - n0 - c)));
      }
    }
  }
}

// Rows [m0, m1) of x (as the micro-kernel reads them: XF) times blocks [b0, b1).
template <typename T, typename XF>
void sweep(const Problem& p, const XF* xs, int64_t ldxs, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  constexpr int step = k_step<T>();
  const Shape& s = p.shape;
  const int64_t kp = s.padded_k(step);
  const int64_t steps = kp / step;  // k-steps per block
  const T* packed = static_cast<const T*>(p.packed);
  T* y = static_cast<T*>(p.y);
  const int cols = s.gated ? kBlock / 2 : kBlock;
  const RowGroups rows(m1 - m0);
  // One group runs through the whole block at once; several share each L1-sized chunk.
  const int64_t chunk = rows.groups == 1 ? steps : std::max<int64_t>(1, kChunkBytes / (step * kBlock * sizeof(T)));
  std::vector<vfloat> parked(static_cast<size_t>(rows.groups * kMR * kVecs));
  auto parked_acc = [&](int64_t g) { return reinterpret_cast<vfloat(*)[kVecs]>(parked.data() + g * kMR * kVecs); };
  for (int64_t b = b0; b < b1; ++b) {
    const T* blk = packed + b * kp * kBlock;
    std::fill(parked.begin(), parked.end(), vfloat{});
    for (int64_t k0 = 0; k0 < steps; k0 += chunk) {
      const int64_t n = std::min(chunk, steps - k0);
      for (int64_t g = 0; g < rows.groups; ++g) {
        const int mr = rows.size(g);
        const XF* xr[kMR];
        for (int i = 0; i < kMR; ++i) xr[i] = xs + (m0 + rows.start(g) + std::min(i, mr - 1)) * ldxs + k0 * step;
        // Only the first group streams the chunk from memory (and prefetches); the others find it in L1.
        const int64_t ahead = g == 0 ? kPrefetchBlocks * kp * kBlock : 0;
        group_dispatch<T, XF>(mr, blk + k0 * step * kBlock, xr, n, ahead, parked_acc(g));
      }
    }
    for (int64_t g = 0; g < rows.groups; ++g)
      store_group(p, parked_acc(g), rows.size(g), y + (m0 + rows.start(g)) * s.N, b * cols);
  }
}

template <typename T>
void run(const Problem& p) {
  constexpr int step = k_step<T>();
  const Shape& s = p.shape;
  const T* x = static_cast<const T*>(p.x);
  // What the micro-kernel reads of x: bf16 pairs as they are (zero-padded to an even K)
  // with the bf16 dot product; else fp32, widened and zero-padded once (M x K is small
  // beside the weights).
  using XF = std::conditional_t<step == 2, uint16_t, float>;
  const int64_t kp = s.padded_k(step);
  std::vector<XF> copy;
  const XF* xs = reinterpret_cast<const XF*>(x);
  int64_t ldxs = p.ldx;
  if (!std::is_same_v<T, XF> || kp != s.K) {
    copy.assign(static_cast<size_t>(p.M * kp), XF{});
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t k = 0; k < s.K; ++k) {
        const T v = x[m * p.ldx + k];
        if constexpr (std::is_same_v<XF, float> && std::is_same_v<T, uint16_t>)
          copy[m * kp + k] = bf16_to_float(v);
        else
          copy[m * kp + k] = static_cast<XF>(v);
      }
    xs = copy.data();
    ldxs = kp;
  }
  const int64_t blocks = s.blocks();
  for (int64_t m0 = 0; m0 < p.M; m0 += kMacroRows) {
    const int64_t m1 = std::min(p.M, m0 + kMacroRows);
    // Each chunk is a run of whole blocks, streamed by one thread (work_pool.h).
    share_items(blocks, kBlock * kp * (m1 - m0), [&](int64_t b0, int64_t b1) { sweep<T, XF>(p, xs, ldxs, m0, m1, b0, b1); });
  }
}

Shape shape_of(int64_t out_features, int64_t in_features, bool gated) { return {out_features, in_features, gated}; }

template <typename T>
int64_t packed_elements(const Shape& s) {
  return s.blocks() * s.padded_k(k_step<T>()) * kBlock;
}

at::Tensor pack_linear(const at::Tensor& weight, bool gated) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "pack_linear: weight must be a contiguous [N, K]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_linear: fp32 or bf16 weights only");
  TORCH_CHECK(!gated || weight.size(0) % 2 == 0, "pack_linear: a gated weight stacks gate and up rows");
  const Shape s = shape_of(gated ? weight.size(0) / 2 : weight.size(0), weight.size(1), gated);
  if (weight.scalar_type() == at::kFloat) {
    at::Tensor out = at::empty({packed_elements<float>(s)}, weight.options());
    pack(weight.data_ptr<float>(), s, out.data_ptr<float>());
    return out;
  }
  at::Tensor out = at::empty({packed_elements<uint16_t>(s)}, weight.options());
  pack(reinterpret_cast<const uint16_t*>(weight.data_ptr()), s, reinterpret_cast<uint16_t*>(out.data_ptr()));
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t in_features,
                  c10::string_view activation) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be [M, K] with contiguous rows");
  TORCH_CHECK(x.size(1) == in_features, "linear: x has ", x.size(1), " features, the weight ", in_features);
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear: x and the weight differ in dtype");
  TORCH_CHECK(activation.empty() || activation == "silu" || activation == "gelu_tanh",
              "linear: activation must be '', 'silu' or 'gelu_tanh'");
  const Act act = activation.empty() ? Act::kNone : activation == "silu" ? Act::kSilu : Act::kGeluTanh;
  const Shape s = shape_of(out_features, in_features, act != Act::kNone);
  const bool f32 = x.scalar_type() == at::kFloat;
  TORCH_CHECK(packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == (f32 ? packed_elements<float>(s) : packed_elements<uint16_t>(s)),
              "linear: the packed weight does not match out_features / in_features / activation");
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0 || out_features == 0) return y;
  const Problem p{x.data_ptr(), x.stride(0), packed.data_ptr(), y.data_ptr(), x.size(0), s, act};
  if (f32)
    run<float>(p);
  else
    run<uint16_t>(p);
  return y;
}

}  // namespace

at::Tensor pagedserve_cpu::linear_packed(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                                         int64_t in_features, c10::string_view activation) {
  return ::linear(x, packed, out_features, in_features, activation);
}

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("pack_linear(Tensor weight, bool gated) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, int in_features, str activation) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
