// Paged attention for the CPU that reads K/V blocks where they lie in the cache.
//
// One op, pagedserve_cpu::paged_attention, covers decode (one query row per
// sequence: cu_query_lens = None) and prefill with context (varlen rows), every
// cache dtype (fp32 / bf16 / fp16, and fp8 e4m3 / int8 with per-token-per-head
// scales and zero points), GQA/MQA, sliding windows and Gemma 2's score soft-cap
// (softcap > 0: scores = softcap * tanh(scores / softcap) before the mask and the
// softmax). Its semantics are those of
// kernels/reference.py (paged_prefill_attention / paged_decode_attention), the
// test oracle: K/V are dequantized to fp32 and rounded to the query's dtype, as
// the reference's `.to(query.dtype)` does, then attended in fp32 with an online
// softmax over one block at a time; the output is rounded to the query's dtype.
//
// Work item: a sequence's tile of up to kRowTile query rows, for all its KV heads
// when there are enough sequences to keep every thread busy, else for one KV head; a
// call with few decode rows cuts their contexts into segments, items of their own, whose
// partial softmax states are merged after.
// Per block and KV head, K and V serve all the item's rows and every query head of
// the KV head's group: read where they lie when the cache's values are already the
// query dtype's (fp32; bf16 for fp32 and bf16 queries), else converted once into small
// fp32 buffers. A block is read from the cache once per item, never copied into a
// gathered context, and the next block is prefetched in software: blocks lie anywhere
// in the cache, where the hardware prefetcher cannot follow. Decode rows (a GQA group
// of query vectors per KV head) take tiles of 4 keys x 3 query vectors (attend_queries;
// attend_block for head dims other than 64 and 128), which replaced a dot product a
// key (bench/results/cpu_attention_kernel.md). A prefill tile with at least
// half a vector of query vectors per KV head puts them across the vector lanes
// (attend_item_lanes), a matrix-shaped inner
// kernel: 1.1-1.9x the reference over a long context and for fresh prompts, where the
// row-at-a-time version was 0.67-0.77x (bench/results/cpu_attention.md).
//
// This file walks the work items and their blocks; the arithmetic over one block's keys
// (attend_block, attend_queries, lanes_chunk) is in paged_attention_tiles.h.
//
// Built by kernels/cpu_build.py with torch.utils.cpp_extension (-O3 -march=native
// -fopenmp: the loops below are written for the compiler's vectorizer).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <omp.h>

#include "cpu_vec.h"
#include "paged_attention_args.h"
#include "paged_attention_plan.h"
#include "paged_attention_tiles.h"
#include "work_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace pagedserve_cpu;
using namespace pagedserve_cpu::attention;

// Start fetching a block's K and V of heads [h0, h1): the block lies anywhere in the
// cache, so the hardware prefetcher cannot guess it.
template <typename CT>
inline void prefetch_block(const CT* k_cache, const CT* v_cache, int64_t offset, int64_t elements) {
  const char* k = reinterpret_cast<const char*>(k_cache + offset);
  const char* v = reinterpret_cast<const char*>(v_cache + offset);
  const int64_t bytes = elements * static_cast<int64_t>(sizeof(CT));
  for (int64_t off = 0; off < bytes; off += 64) {
    __builtin_prefetch(k + off);
    __builtin_prefetch(v + off);
  }
}

// Whether a block of cache C is used where it lies, without the fp32 staging copy: its
// values are already the query dtype's (fp32 as is, bf16 and fp16 widened exactly by vload).
template <typename Q, template <typename> class C>
constexpr bool kInPlace = std::is_same_v<C<Q>, CF32<QF32>> || std::is_same_v<C<Q>, CBF16<QF32>> ||
                          std::is_same_v<C<Q>, CBF16<QBF16>> || std::is_same_v<C<Q>, CF16<QF32>> ||
                          std::is_same_v<C<Q>, CF16<QF16>>;

// Every block of the item's sequence that query positions [first_pos, first_pos + rows)
// see (their sliding windows included), for each KV head of the item: that head's K and
// V of the block, [block_size][d], then body(h, j0, n, k, v, k_next, v_next) for its keys
// j0 .. j0 + n - 1. InPlace: k and v point into the cache, and k_next / v_next to the
// same head's rows of the next block (nullptr at the last), for the body to prefetch a
// few rows at a time beside its arithmetic; else k and v are kb / vb, the block read as
// fp32 rounded to the query's dtype, and the next block is prefetched here as it is read.
template <typename Q, template <typename> class C, bool InPlace, typename Body>
inline void for_each_block(const Args& a, const WorkItem& w, int first_pos, int rows, int d, float* kb, float* vb,
                           Body&& body) {
  using CT = typename C<Q>::T;
  const int bs = a.block_size, heads = w.head_end - w.head_begin;
  const int last_pos = first_pos + rows - 1;
  const int key_lo = a.sliding_window > 0 ? std::max(0, first_pos - a.sliding_window + 1) : 0;
  const int key_hi = last_pos + 1;  // exclusive
  const int32_t* table = a.block_tables + static_cast<int64_t>(w.seq) * a.table_stride;
  const int64_t head_stride = static_cast<int64_t>(bs) * d;
  const int64_t block_stride = a.num_kv_heads * head_stride;
  const CT* k_cache = static_cast<const CT*>(a.k_cache);
  const CT* v_cache = static_cast<const CT*>(a.v_cache);
  const int blk_end = std::min(w.block_end, (key_hi + bs - 1) / bs);
  for (int blk = std::max(key_lo / bs, w.block_begin); blk < blk_end; ++blk) {
    const int64_t phys = table[blk];
    const int j0 = blk * bs;
    const int n = std::min(bs, key_hi - j0);
    const bool has_next = blk + 1 < blk_end;
    if (!InPlace && has_next)
      prefetch_block(k_cache, v_cache, table[blk + 1] * block_stride + w.head_begin * head_stride, heads * head_stride);
    for (int h = 0; h < heads; ++h) {
      const int kv_head = w.head_begin + h;
      const int64_t base = phys * block_stride + kv_head * head_stride;
      if constexpr (InPlace) {
        const int64_t next = has_next ? table[blk + 1] * block_stride + kv_head * head_stride : -1;
        body(h, j0, n, k_cache + base, v_cache + base, next < 0 ? nullptr : k_cache + next,
             next < 0 ? nullptr : v_cache + next);
      } else {
        const int64_t sbase = (phys * a.num_kv_heads + kv_head) * bs;
        read_block<Q, C>(k_cache + base, a.k_scale, a.k_zero, sbase, n, d, kb);
        read_block<Q, C>(v_cache + base, a.v_scale, a.v_zero, sbase, n, d, vb);
        const float* none = nullptr;
        body(h, j0, n, static_cast<const float*>(kb), static_cast<const float*>(vb), none, none);
      }
    }
  }
}

template <typename Q, template <typename> class C, int D>
void attend_item(const Args& a, const WorkItem& w, std::vector<float>& scratch) {
  using QT = typename Q::T;
  const int d = D > 0 ? D : a.head_dim, bs = a.block_size, group = a.num_heads / a.num_kv_heads;
  const int rows = w.row_end - w.row_begin, heads = w.head_end - w.head_begin;
  const int nq = heads * rows * group;  // query vectors: [head][row][group]
  const int q_begin = a.cu_query_lens ? a.cu_query_lens[w.seq] : w.seq;
  const int q_len = a.cu_query_lens ? a.cu_query_lens[w.seq + 1] - q_begin : 1;
  const int ctx = a.context_lens[w.seq];

  // scratch: q [nq][d] | acc [nq][d] | k, v [bs][d] | m, l [nq] | scores [3][ss]
  const int ss = (bs + kLanes - 1) / kLanes * kLanes;
  scratch.resize(static_cast<size_t>(2 * nq * d + 2 * bs * d + 2 * nq + 3 * ss));
  float* qf = scratch.data();
  float* acc = qf + nq * d;
  float* kb = acc + nq * d;
  float* vb = kb + bs * d;
  float* m = vb + bs * d;
  float* l = m + nq;
  float* scores = l + nq;

  const QT* query = static_cast<const QT*>(a.query);
  for (int h = 0; h < heads; ++h)
    for (int r = 0; r < rows; ++r)
      for (int g = 0; g < group; ++g) {
        const int t = q_begin + w.row_begin + r;
        const QT* src = query + t * a.q_stride_t + ((w.head_begin + h) * group + g) * a.q_stride_h;
        float* dst = qf + ((h * rows + r) * group + g) * d;
        for (int i = 0; i < d; ++i) dst[i] = Q::load(src[i]) * a.scale;
      }
  std::fill(acc, acc + nq * d, 0.0f);
  std::fill(m, m + nq, kNegBig);
  std::fill(l, l + nq, 0.0f);

  // Positions of the tile's rows: first_pos .. first_pos + rows - 1.
  const int first_pos = ctx - q_len + w.row_begin;
  // head_dim 64 / 128: the group's query vectors of a row share each key's loads
  // (attend_queries), from the cache itself where its values need no rounding.
  constexpr bool in_place = D > 0 && kInPlace<Q, C>;
  for_each_block<Q, C, in_place>(a, w, first_pos, rows, d, kb, vb, [&](int h, int j0, int n, auto k, auto v, auto k_next, auto v_next) {
    for (int r = 0; r < rows; ++r) {
      const int pos = first_pos + r;
      const int lo = std::max(j0, a.sliding_window > 0 ? pos - a.sliding_window + 1 : 0) - j0;
      const int hi = std::min(j0 + n, pos + 1) - j0;  // keys [lo, hi) of this block
      if (lo >= hi) continue;
      const int q0 = (h * rows + r) * group;
      if constexpr (D > 0) {
        attend_queries<D>(group, qf + q0 * d, k, v, k_next, v_next, bs, ss, lo, hi, a.softcap, scores, m + q0,
                          l + q0, acc + q0 * d);
      } else {
        for (int g = 0; g < group; ++g)
          attend_block(qf + (q0 + g) * d, k, v, d, lo, hi, a.softcap, scores, m[q0 + g], l[q0 + g],
                       acc + (q0 + g) * d);
      }
    }
  });

  if (w.part >= 0) {  // a segment of a decode context: its state, merged by merge_splits
    float* slot = a.partials + w.part * a.partial_stride;
    std::copy(acc, acc + nq * d, slot);
    std::copy(m, m + nq, slot + nq * d);
    std::copy(l, l + nq, slot + nq * d + nq);
    return;
  }
  QT* out = static_cast<QT*>(a.out);
  for (int h = 0; h < heads; ++h)
    for (int r = 0; r < rows; ++r)
      for (int g = 0; g < group; ++g) {
        const int qi = (h * rows + r) * group + g;
        const int t = q_begin + w.row_begin + r;
        const float inv = 1.0f / l[qi];
        QT* dst = out + (static_cast<int64_t>(t) * a.num_heads + (w.head_begin + h) * group + g) * d;
        const float* o = acc + qi * d;
        for (int i = 0; i < d; ++i) dst[i] = Q::store(o[i] * inv);
      }
}

// A prefill tile with its query vectors across the vector lanes: per KV head, the
// tile's rows x group query vectors (lane k: row k / group, query head k % group of the
// group), kLanes at a time. Scores come kLanes queries per FMA (one key element
// broadcast against a column of the transposed queries), so a block of keys costs
// head_dim x keys FMAs per kLanes queries and no horizontal sum; the online softmax runs
// per lane, and P.V accumulates each query's output row from V's rows. This is the
// matrix-shaped inner kernel prefill over a long context needs (a row at a time it did
// 16 x 3 dot products per key); decode rows (a group of 1-8 query vectors) take
// attend_queries.
template <typename Q, template <typename> class C, int D>
void attend_item_lanes(const Args& a, const WorkItem& w, std::vector<float>& scratch) {
  using QT = typename Q::T;
  const int bs = a.block_size, group = a.num_heads / a.num_kv_heads;
  const int rows = w.row_end - w.row_begin, heads = w.head_end - w.head_begin;
  const int lanes = rows * group;                         // query vectors per KV head
  const int lane_groups = (lanes + kLanes - 1) / kLanes;  // vectors of them
  const int padded_bs = (bs + kLanes - 1) / kLanes * kLanes;
  const int q_begin = a.cu_query_lens[w.seq];
  const int q_len = a.cu_query_lens[w.seq + 1] - q_begin;
  const int ctx = a.context_lens[w.seq];

  // scratch: qt [heads][lane_groups][D][kLanes] | acc [heads][lane_groups * kLanes][D] |
  // m, l [heads][lane_groups][kLanes] | k, v [padded_bs][D] | p [kLanes][kLanes]
  const size_t n_qt = static_cast<size_t>(heads) * lane_groups * D * kLanes;
  const size_t n_ml = static_cast<size_t>(heads) * lane_groups * kLanes;
  scratch.assign(2 * n_qt + 2 * n_ml + 2 * static_cast<size_t>(padded_bs) * D + kLanes * kLanes, 0.0f);
  float* qt = scratch.data();
  float* acc = qt + n_qt;
  float* m = acc + n_qt;
  float* l = m + n_ml;
  float* kb = l + n_ml;
  float* vb = kb + static_cast<size_t>(padded_bs) * D;
  float* pbuf = vb + static_cast<size_t>(padded_bs) * D;
  std::fill(m, m + n_ml, kNegBig);

  const QT* query = static_cast<const QT*>(a.query);
  const int first_pos = ctx - q_len + w.row_begin;
  for (int h = 0; h < heads; ++h)
    for (int k = 0; k < lanes; ++k) {
      const int r = k / group, g = k % group;
      const QT* src = query + (q_begin + w.row_begin + r) * a.q_stride_t + ((w.head_begin + h) * group + g) * a.q_stride_h;
      float* dst = qt + (static_cast<size_t>(h) * lane_groups + k / kLanes) * D * kLanes + k % kLanes;
      for (int i = 0; i < D; ++i) dst[i * kLanes] = Q::load(src[i]) * a.scale;
    }
  // Lane positions; lanes past the tile's query vectors get -1 (every key masked).
  std::vector<vint> pos(lane_groups);
  for (int lg = 0; lg < lane_groups; ++lg) {
    int32_t p[kLanes];
    for (int t = 0; t < kLanes; ++t) {
      const int k = lg * kLanes + t;
      p[t] = k < lanes ? first_pos + k / group : -1;
    }
    std::memcpy(&pos[lg], p, sizeof p);
  }

  for_each_block<Q, C, false>(a, w, first_pos, rows, D, kb, vb, [&](int h, int j0, int n, const float*, const float*, const float*, const float*) {
    for (int lg = 0; lg < lane_groups; ++lg) {
      const size_t at = static_cast<size_t>(h) * lane_groups + lg;
      vfloat mv = vload(m + at * kLanes), lv = vload(l + at * kLanes);
      const int used = std::min(kLanes, lanes - lg * kLanes);
      for (int jc = 0; jc < n; jc += kLanes)
        lanes_chunk<D>(qt + at * D * kLanes, kb, vb, jc, std::min(kLanes, n - jc), j0, pos[lg], a.sliding_window,
                       a.softcap, mv, lv, acc + at * kLanes * D, used, pbuf);
      vstore(m + at * kLanes, mv);
      vstore(l + at * kLanes, lv);
    }
  });

  QT* out = static_cast<QT*>(a.out);
  for (int h = 0; h < heads; ++h)
    for (int k = 0; k < lanes; ++k) {
      const int r = k / group, g = k % group;
      const size_t at = static_cast<size_t>(h) * lane_groups + k / kLanes;
      const float inv = 1.0f / l[at * kLanes + k % kLanes];
      const float* o = acc + (at * kLanes + k % kLanes) * D;
      QT* dst = out + (static_cast<int64_t>(q_begin + w.row_begin + r) * a.num_heads + (w.head_begin + h) * group + g) * D;
      for (int i = 0; i < D; ++i) dst[i] = Q::store(o[i] * inv);
    }
}

template <typename Q, template <typename> class C>
void attend_one(const Args& a, const WorkItem& w, std::vector<float>& scratch) {
  // Enough query vectors per KV head to fill the lanes: the matrix-shaped tile.
  const int group = a.num_heads / a.num_kv_heads;
  const bool lanes = a.cu_query_lens != nullptr && (w.row_end - w.row_begin) * group >= kLanes / 2;
  if (a.head_dim == 64) {
    lanes ? attend_item_lanes<Q, C, 64>(a, w, scratch) : attend_item<Q, C, 64>(a, w, scratch);
  } else if (a.head_dim == 128) {
    lanes ? attend_item_lanes<Q, C, 128>(a, w, scratch) : attend_item<Q, C, 128>(a, w, scratch);
  } else {
    attend_item<Q, C, 0>(a, w, scratch);
  }
}

template <typename Q, template <typename> class C>
void run(const Args& args) {
  const int torch_threads = at::get_num_threads();
  const Plan plan = work_items(args, torch_threads == 1 ? pool::team() : torch_threads);
  Args a = args;
  thread_local std::vector<float> partials;
  if (plan.parts) {
    const int heads = plan.splits.front().head_end - plan.splits.front().head_begin;
    a.partial_stride = static_cast<int64_t>(heads) * (a.num_heads / a.num_kv_heads) * (a.head_dim + 2);
    partials.resize(plan.parts * a.partial_stride);
    a.partials = partials.data();
  }
  const std::vector<WorkItem>& items = plan.items;
  const int n = static_cast<int>(items.size());
  if (torch_threads == 1) {
    // A small step's one torch thread (svc_common/cpu_features.py's plan): the work
    // pool's helpers take items as they come, one item per chunk (each is worth one).
    share_items(n, pool::chunk_work(), [&](int64_t begin, int64_t end) {
      thread_local std::vector<float> scratch;
      for (int64_t i = begin; i < end; ++i) attend_one<Q, C>(a, items[i], scratch);
    });
  } else {
    const int threads = std::max(1, std::min(torch_threads, n));
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < n; ++i) attend_one<Q, C>(a, items[i], scratch);
    }
  }
  merge_splits<Q>(a, plan.splits);
}

template <typename Q>
void dispatch_cache(const Args& a, at::ScalarType cache) {
  switch (cache) {
    case at::kFloat: return run<Q, CF32>(a);
    case at::kBFloat16: return run<Q, CBF16>(a);
    case at::kHalf: return run<Q, CF16>(a);
    case at::kFloat8_e4m3fn: return run<Q, CFP8>(a);
    case at::kChar: return run<Q, CINT8>(a);
    default: TORCH_CHECK(false, "paged_attention: unsupported cache dtype ", cache);
  }
}

const float* optional_f32(const std::optional<at::Tensor>& t, const at::Tensor& cache, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), name, " must be contiguous fp32");
  TORCH_CHECK(t->sizes() == cache.sizes().slice(0, 3), name, " must be shaped like the cache minus head_dim");
  return t->data_ptr<float>();
}

const int8_t* optional_i8(const std::optional<at::Tensor>& t, const at::Tensor& cache, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kChar && t->is_contiguous(), name, " must be contiguous int8");
  TORCH_CHECK(t->sizes() == cache.sizes().slice(0, 3), name, " must be shaped like the cache minus head_dim");
  return t->data_ptr<int8_t>();
}

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const std::optional<at::Tensor>& cu_query_lens,
                           const at::Tensor& context_lens, double scale, int64_t sliding_window, double softcap,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                           const std::optional<at::Tensor>& k_zero, const std::optional<at::Tensor>& v_zero) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, heads, head_dim], head_dim contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache and v_cache differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int32 [S, max_blocks]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous(), "context_lens must be int32");
  const int64_t num_seqs = context_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables and context_lens disagree on S");
  const int64_t heads = query.size(1), kv_heads = k_cache.size(1), head_dim = query.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && heads % kv_heads == 0, "query heads / head_dim do not fit the cache");
  TORCH_CHECK(head_dim <= kMaxHeadDim, "head_dim ", head_dim, " > ", kMaxHeadDim);
  const bool quantized = k_cache.scalar_type() == at::kFloat8_e4m3fn || k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(quantized == k_scale.has_value() && quantized == v_scale.has_value(),
              "a quantized cache needs k_scale and v_scale, an unquantized one none");
  TORCH_CHECK((k_cache.scalar_type() == at::kChar) == k_zero.has_value() && k_zero.has_value() == v_zero.has_value(),
              "an int8 cache needs k_zero and v_zero, other caches none");

  Args a{};
  a.query = query.data_ptr();
  a.q_stride_t = query.stride(0);
  a.q_stride_h = query.stride(1);
  a.k_cache = k_cache.data_ptr();
  a.v_cache = v_cache.data_ptr();
  a.k_scale = optional_f32(k_scale, k_cache, "k_scale");
  a.v_scale = optional_f32(v_scale, k_cache, "v_scale");
  a.k_zero = optional_i8(k_zero, k_cache, "k_zero");
  a.v_zero = optional_i8(v_zero, k_cache, "v_zero");
  a.block_tables = block_tables.data_ptr<int32_t>();
  a.table_stride = block_tables.stride(0);
  a.context_lens = context_lens.data_ptr<int32_t>();
  if (cu_query_lens.has_value()) {
    TORCH_CHECK(cu_query_lens->scalar_type() == at::kInt && cu_query_lens->is_contiguous() &&
                    cu_query_lens->size(0) == num_seqs + 1,
                "cu_query_lens must be int32 [S + 1]");
    a.cu_query_lens = cu_query_lens->data_ptr<int32_t>();
    TORCH_CHECK(a.cu_query_lens[num_seqs] == query.size(0), "cu_query_lens[-1] must be the number of query rows");
  } else {
    TORCH_CHECK(query.size(0) == num_seqs, "decode takes one query row per sequence");
  }
  a.num_seqs = static_cast<int>(num_seqs);
  a.num_heads = static_cast<int>(heads);
  a.num_kv_heads = static_cast<int>(kv_heads);
  a.head_dim = static_cast<int>(head_dim);
  a.block_size = static_cast<int>(k_cache.size(2));
  a.scale = static_cast<float>(scale);
  a.sliding_window = static_cast<int>(sliding_window);
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: off), got ", softcap);
  a.softcap = static_cast<float>(softcap);
  // Every position a row attends must have its block in the table.
  const int64_t table_width = block_tables.size(1);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int ctx = a.context_lens[s];
    const int q_len = a.cu_query_lens ? a.cu_query_lens[s + 1] - a.cu_query_lens[s] : 1;
    TORCH_CHECK(q_len >= 0 && ctx >= q_len, "sequence ", s, ": context_len ", ctx, " < query rows ", q_len);
    TORCH_CHECK(q_len == 0 || (ctx + a.block_size - 1) / a.block_size <= table_width, "sequence ", s,
                ": block table too narrow for context_len ", ctx);
  }

  at::Tensor out = at::empty({query.size(0), heads, head_dim}, query.options());
  a.out = out.data_ptr();
  switch (query.scalar_type()) {
    case at::kFloat: dispatch_cache<QF32>(a, k_cache.scalar_type()); break;
    case at::kBFloat16: dispatch_cache<QBF16>(a, k_cache.scalar_type()); break;
    case at::kHalf: dispatch_cache<QF16>(a, k_cache.scalar_type()); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? cu_query_lens, "
      "Tensor context_lens, float scale, int sliding_window, float softcap, Tensor? k_scale, Tensor? v_scale, "
      "Tensor? k_zero, Tensor? v_zero) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
