// How one paged_attention call is cut into work items (work_items), and the merge of a
// decode context attended in segments (merge_splits). Included by paged_attention_cpu.cpp.
#pragma once

#include <algorithm>
#include <vector>

#include "cpu_vec.h"
#include "paged_attention_args.h"

namespace pagedserve_cpu::attention {

// A call with few (sequence, KV head) pairs of decode rows cuts each row's context into
// segments of whole blocks, at least kSplitKeys keys each, until it has about kSplitItems
// work items; the segments' partial softmax states are merged after (merge_splits). One
// sequence has only as many items as KV heads otherwise (3 on 2 threads left one idle a
// third of the time; on many cores most of them idle). Each segment costs a cold first
// block and a merge, so a batch with items enough is not cut. Side by side (one torch
// thread and the work pool on 2 cores, bf16 cache, 30 layers' tables, fastest of 30
// rounds): 1 x 320 keys 17.6-18.0 -> 15.0-15.6 us, 1 x 1024 51-60 -> 41-43 us; cutting
// 4 x 1024 into 8 segments each had cost 180 -> 188 us. The cut depends on the batch and the
// contexts, never on the threads, so an output has the same bits with the work pool on or
// off and on any number of cores.
constexpr int kSplitKeys = 128;
constexpr int kSplitItems = 12;

// A decode context cut into segments: parts [first_part, first_part + parts) of
// Args::partials hold the KV heads [head_begin, head_end) of seq.
struct Split {
  int seq, head_begin, head_end, first_part, parts;
};

struct Plan {
  std::vector<WorkItem> items;
  std::vector<Split> splits;
  int parts = 0;
};

// The keys an item reads (sliding windows aside): what the schedule orders it by.
inline int item_keys(const Args& a, const WorkItem& w) {
  const int q_len = a.cu_query_lens ? a.cu_query_lens[w.seq + 1] - a.cu_query_lens[w.seq] : 1;
  const int hi = std::min(a.context_lens[w.seq] - q_len + w.row_end, w.block_end == INT_MAX ? INT_MAX : w.block_end * a.block_size);
  return hi - w.block_begin * a.block_size;
}

inline Plan work_items(const Args& a, int threads) {
  // All KV heads of a sequence in one item when there are enough sequences to keep every
  // thread busy (its blocks are then read as one run of kv_heads * block_size rows);
  // one item per head otherwise (a single long sequence still spreads over the threads).
  const int heads_per_item = a.num_seqs >= 4 * threads ? a.num_kv_heads : 1;
  const int pairs = a.num_seqs * a.num_kv_heads;
  const int wanted_parts = a.cu_query_lens == nullptr ? (kSplitItems + pairs - 1) / pairs : 1;
  const int split_blocks = std::max(1, kSplitKeys / a.block_size);
  Plan plan;
  for (int s = 0; s < a.num_seqs; ++s) {
    const int q_len = a.cu_query_lens ? a.cu_query_lens[s + 1] - a.cu_query_lens[s] : 1;
    const int ctx = a.context_lens[s];
    // A decode row's blocks from its window's first (all of them without a window).
    const int first = a.sliding_window > 0 ? std::max(0, ctx - a.sliding_window) / a.block_size : 0;
    const int blocks = (ctx + a.block_size - 1) / a.block_size - first;
    const int parts = std::max(1, std::min(wanted_parts, blocks / split_blocks));
    for (int h = 0; h < a.num_kv_heads; h += heads_per_item) {
      const int h_end = std::min(a.num_kv_heads, h + heads_per_item);
      if (parts > 1) {
        plan.splits.push_back({s, h, h_end, plan.parts, parts});
        for (int p = 0; p < parts; ++p)
          plan.items.push_back({s, h, h_end, 0, 1, first + p * blocks / parts, first + (p + 1) * blocks / parts, plan.parts++});
        continue;
      }
      for (int r = 0; r < q_len; r += kRowTile) plan.items.push_back({s, h, h_end, r, std::min(q_len, r + kRowTile)});
    }
  }
  // Most keys first, so the dynamic schedule ends with the short items.
  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [&](const WorkItem& x, const WorkItem& y) { return item_keys(a, x) > item_keys(a, y); });
  return plan;
}

// Each split's segments into its decode row's output: the online softmax's merge of
// partial states (m, l, unnormalized output) by their common maximum.
template <typename Q>
void merge_splits(const Args& a, const std::vector<Split>& splits) {
  using QT = typename Q::T;
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  for (const Split& sp : splits) {
    const int nq = (sp.head_end - sp.head_begin) * group;
    for (int qi = 0; qi < nq; ++qi) {
      auto slot = [&](int p) { return a.partials + (sp.first_part + p) * a.partial_stride; };
      float m_max = kNegBig;
      for (int p = 0; p < sp.parts; ++p) m_max = std::max(m_max, slot(p)[nq * d + qi]);
      float o[kMaxHeadDim] = {};
      float l = 0.0f;
      for (int p = 0; p < sp.parts; ++p) {
        const float weight = exp_neg(slot(p)[nq * d + qi] - m_max);
        l += slot(p)[nq * d + nq + qi] * weight;
        const float* acc = slot(p) + qi * d;
        for (int i = 0; i < d; ++i) o[i] += acc[i] * weight;
      }
      const float inv = 1.0f / l;
      QT* dst = static_cast<QT*>(a.out) + (static_cast<int64_t>(sp.seq) * a.num_heads + sp.head_begin * group + qi) * d;
      for (int i = 0; i < d; ++i) dst[i] = Q::store(o[i] * inv);
    }
  }
}

}  // namespace pagedserve_cpu::attention
