// What paged_attention_cpu.cpp's kernels share: the element types (how a query dtype
// rounds, how each cache dtype reads into fp32), one call's arguments (Args) and a unit
// of its work (WorkItem). Included by paged_attention_cpu.cpp and paged_attention_plan.h.
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <array>
#include <climits>
#include <cstdint>

#include "cpu_vec.h"

namespace pagedserve_cpu::attention {

constexpr int kRowTile = 16;
constexpr float kNegBig = -1e30f;  // a finite "minus infinity": exp underflows to 0

// ---- element conversions ----------------------------------------------------------
inline const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// The query dtype: how a value is rounded to it (K/V after dequantization, the output).
struct QF32 {
  using T = float;
  static float load(T x) { return x; }
  static float round(float x) { return x; }
  static T store(float x) { return x; }
};
struct QBF16 {
  using T = uint16_t;
  static float load(T x) { return bf16_to_float(x); }
  static float round(float x) { return bf16_to_float(float_to_bf16_bits(x)); }
  static T store(float x) { return float_to_bf16_bits(x); }
};
struct QF16 {
  using T = _Float16;
  static float load(T x) { return static_cast<float>(x); }
  static float round(float x) { return static_cast<float>(static_cast<_Float16>(x)); }
  static T store(float x) { return static_cast<_Float16>(x); }
};

// The cache dtype: reading `n` consecutive values of one token into fp32, rounded
// to the query's dtype (scale / zero: that token's, for the quantized dtypes).
template <typename Q>
struct CF32 {
  using T = float;
  static void read(const T* src, int n, float, int8_t, float* dst) {
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = Q::round(src[i]);
  }
};
template <typename Q>
struct CBF16 {
  using T = uint16_t;
  static void read(const T* src, int n, float, int8_t, float* dst) {
    if constexpr (std::is_same_v<Q, QBF16> || std::is_same_v<Q, QF32>) {  // exact in the query's dtype
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
      return;
    }
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = Q::round(bf16_to_float(src[i]));
  }
};
template <typename Q>
struct CF16 {
  using T = _Float16;
  static void read(const T* src, int n, float, int8_t, float* dst) {
    if constexpr (std::is_same_v<Q, QF16> || std::is_same_v<Q, QF32>) {  // exact in the query's dtype
#pragma omp simd
      for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
      return;
    }
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = Q::round(static_cast<float>(src[i]));
  }
};
template <typename Q>
struct CFP8 {
  using T = uint8_t;
  static void read(const T* src, int n, float scale, int8_t, float* dst) {
    const float* table = fp8_table().data();
    for (int i = 0; i < n; ++i) dst[i] = Q::round(table[src[i]] * scale);
  }
};
template <typename Q>
struct CINT8 {
  using T = int8_t;
  static void read(const T* src, int n, float scale, int8_t zero, float* dst) {
    const float z = static_cast<float>(zero);
#pragma omp simd
    for (int i = 0; i < n; ++i) dst[i] = Q::round((static_cast<float>(src[i]) - z) * scale);
  }
};

struct Args {
  const void* query;
  int64_t q_stride_t, q_stride_h;
  const void* k_cache;
  const void* v_cache;
  const float* k_scale;
  const float* v_scale;
  const int8_t* k_zero;
  const int8_t* v_zero;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* cu_query_lens;  // nullptr: decode, row s of sequence s
  const int32_t* context_lens;
  void* out;
  int num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int sliding_window;
  float softcap;  // 0: scores are not capped
  float* partials;         // a split decode's segments: [part][nq][head_dim] outputs, then m[nq], l[nq]
  int64_t partial_stride;  // floats a part
};

// n tokens of one block and KV head, [n][d] in the cache, into fp32 dst [n][d].
template <typename Q, template <typename> class C>
inline void read_block(const typename C<Q>::T* src, const float* scale, const int8_t* zero, int64_t sbase, int n,
                       int d, float* dst) {
  if (scale == nullptr) {
    C<Q>::read(src, n * d, 1.0f, 0, dst);  // one contiguous run: the whole [n][d]
    return;
  }
  for (int j = 0; j < n; ++j)
    C<Q>::read(src + j * d, d, scale[sbase + j], zero ? zero[sbase + j] : int8_t{0}, dst + j * d);
}

struct WorkItem {
  int seq, head_begin, head_end;  // KV heads [head_begin, head_end) of seq
  int row_begin, row_end;         // query rows [row_begin, row_end) of seq
  int block_begin = 0, block_end = INT_MAX;  // the blocks of the context it reads
  int part = -1;  // a decode context's segment: its slot in Args::partials (-1: writes the output)
};

// The largest head_dim the kernel takes (a query's running output lives on the stack).
constexpr int kMaxHeadDim = 512;

}  // namespace pagedserve_cpu::attention
