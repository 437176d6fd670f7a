// The inner kernels of the CPU paged attention (paged_attention_cpu.cpp walks the blocks
// and the work items and calls them): arithmetic over one block's keys already in hand,
// reading nothing beyond the pointers they are given but the next block's rows they
// prefetch. attend_block: one query vector, any head dim; attend_queries: a GQA group of
// decode query vectors, head dims 64 and 128; lanes_chunk: a prefill tile's query vectors
// across the vector lanes. Included by paged_attention_cpu.cpp only.
#pragma once

#include <algorithm>
#include <cmath>

#include "cpu_vec.h"
#include "paged_attention_args.h"

namespace pagedserve_cpu::attention {

// Attention of one query vector (head g of row r) over keys [lo, hi) of the block in
// kb / vb, for a head_dim without a compiled tile (attend_queries serves 64 and 128):
// scores (capped where cap > 0), the online-softmax update of (m, l), and the running
// output o.
inline void attend_block(const float* __restrict__ q_in, const float* __restrict__ kb,
                         const float* __restrict__ vb, int d, int lo, int hi, float cap, float* __restrict__ scores,
                         float& m, float& l, float* __restrict__ o_io) {
  float q[kMaxHeadDim], o[kMaxHeadDim];
  for (int i = 0; i < d; ++i) q[i] = q_in[i];
  float block_max = kNegBig;
  for (int j = lo; j < hi; ++j) {
    const float* __restrict__ k = kb + j * d;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int i = 0; i < d; ++i) dot += q[i] * k[i];
    scores[j] = dot;
    block_max = std::max(block_max, dot);
  }
  if (cap > 0.0f) {  // a pass of its own: the uncapped dot-product loop stays as it was
    block_max = kNegBig;
    for (int j = lo; j < hi; ++j) {
      scores[j] = cap * std::tanh(scores[j] / cap);
      block_max = std::max(block_max, scores[j]);
    }
  }
  const float m_new = std::max(m, block_max);
  const float correction = exp_neg(m - m_new);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = lo; j < hi; ++j) {
    scores[j] = exp_neg(scores[j] - m_new);
    sum += scores[j];
  }
  m = m_new;
  l = l * correction + sum;
#pragma omp simd
  for (int i = 0; i < d; ++i) o[i] = o_io[i] * correction;
  for (int j = lo; j < hi; ++j) {
    const float p = scores[j];
    const float* __restrict__ v = vb + j * d;
#pragma omp simd
    for (int i = 0; i < d; ++i) o[i] += p * v[i];
  }
  for (int i = 0; i < d; ++i) o_io[i] = o[i];
}

// ---- decode rows: NQ query vectors of a KV head against a block's keys ----------------
// Start fetching row j of a block (nullptr: none). A burst of a whole block's prefetches
// fills the core's miss buffers and stalls it; a row beside each row's arithmetic does not.
template <int D, typename KT>
inline void prefetch_row(const KT* next, int j) {
  if (next == nullptr) return;
  const char* row = reinterpret_cast<const char*>(next + j * D);
  for (int b = 0; b < D * static_cast<int>(sizeof(KT)); b += 64) __builtin_prefetch(row + b);
}

// Scores s[g][j] (row stride ss) of queries q [NQ][D] against keys [lo, hi) of a block k
// [bs][D]: 4 keys x NQ queries a pass, each key vector loaded once for all NQ queries and
// each of the 4 x NQ dot products in its own register (a dot product a key in one FMA
// chain waited on the FMA latency per element vector), summed across lanes four at a
// time. Full passes run while 4 keys lie in the block (scores past hi are ignored).
template <int D, int NQ, typename KT>
inline void score_tile(const float* __restrict__ q, const KT* __restrict__ k, const KT* k_next, int lo, int hi,
                       int ss, int bs, float* __restrict__ s) {
  constexpr int V = D / kLanes;
  int j = lo;
  for (; j < hi && j + 4 <= bs; j += 4) {
    for (int t = 0; t < 4; ++t) prefetch_row<D>(k_next, j + t);
    vfloat acc[NQ][4];
    for (int g = 0; g < NQ; ++g)
      for (int t = 0; t < 4; ++t) acc[g][t] = vfloat{};
    for (int c = 0; c < V; ++c)
      for (int t = 0; t < 4; ++t) {
        const vfloat kv = vload(k + (j + t) * D + c * kLanes);
        for (int g = 0; g < NQ; ++g) acc[g][t] += vload(q + g * D + c * kLanes) * kv;
      }
    for (int g = 0; g < NQ; ++g) {
      const vfloat4 sums = vsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
      std::memcpy(s + g * ss + j, &sums, sizeof sums);
    }
  }
  for (; j < hi; ++j) {
    prefetch_row<D>(k_next, j);
    vfloat acc[NQ];
    for (int g = 0; g < NQ; ++g) acc[g] = vfloat{};
    for (int c = 0; c < V; ++c) {
      const vfloat kv = vload(k + j * D + c * kLanes);
      for (int g = 0; g < NQ; ++g) acc[g] += vload(q + g * D + c * kLanes) * kv;
    }
    for (int g = 0; g < NQ; ++g) s[g * ss + j] = vsum(acc[g]);
  }
}

// The largest divisor of v that is at most cap (at least 1).
constexpr int divisor_at_most(int v, int cap) {
  int best = 1;
  for (int c = 1; c <= v && c <= cap; ++c)
    if (v % c == 0) best = c;
  return best;
}

// o[g] = o[g] * corr[g] + sum_j p[g][j] v[j] over keys [lo, hi): NQ queries x CV vectors
// of the output a pass, 12 accumulators (AVX2 has 16 registers), each V row loaded once
// a pass for all NQ queries.
template <int D, int NQ, typename KT>
inline void pv_tile(const float* __restrict__ p, int ss, const KT* __restrict__ v, const KT* v_next, int lo, int hi,
                    const float* corr, float* __restrict__ o) {
  constexpr int V = D / kLanes, CV = divisor_at_most(V, std::max(1, 12 / NQ));
  for (int c0 = 0; c0 < V; c0 += CV) {
    vfloat acc[NQ][CV];
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < CV; ++c) acc[g][c] = vload(o + g * D + (c0 + c) * kLanes) * corr[g];
    for (int j = lo; j < hi; ++j) {
      if (c0 == 0) prefetch_row<D>(v_next, j);
      for (int c = 0; c < CV; ++c) {
        const vfloat vv = vload(v + j * D + (c0 + c) * kLanes);
        for (int g = 0; g < NQ; ++g) acc[g][c] += vv * p[g * ss + j];
      }
    }
    for (int g = 0; g < NQ; ++g)
      for (int c = 0; c < CV; ++c) vstore(o + g * D + (c0 + c) * kLanes, acc[g][c]);
  }
}

// Attention of NQ query vectors of one KV head (q [NQ][D], scaled; running m, l, o) over
// keys [lo, hi) of a block: scores (capped where cap > 0), the online-softmax update per
// query a vector of keys at a time (the keys outside [lo, hi) masked), then P.V.
// s: scratch [NQ][ss], ss >= bs a multiple of kLanes.
template <int D, int NQ, typename KT>
inline void attend_group(const float* __restrict__ q, const KT* __restrict__ k, const KT* __restrict__ v,
                         const KT* k_next, const KT* v_next, int bs, int ss, int lo, int hi, float cap,
                         float* __restrict__ s, float* m, float* l, float* __restrict__ o) {
  score_tile<D, NQ>(q, k, k_next, lo, hi, ss, bs, s);
  const int c_lo = lo / kLanes * kLanes;
  vint lane;
  for (int t = 0; t < kLanes; ++t) lane[t] = t;
  float corr[NQ];
  for (int g = 0; g < NQ; ++g) {
    float* __restrict__ sg = s + g * ss;
    vfloat vm = vsplat(kNegBig);
    for (int jc = c_lo; jc < hi; jc += kLanes) {
      const vint key = lane + jc;
      vfloat x = vload(sg + jc);
      if (cap > 0.0f) x = cap * vtanh(x / cap);
      x = (key >= lo && key < hi) ? x : vsplat(kNegBig);
      vstore(sg + jc, x);
      vm = vmax(vm, x);
    }
    const float m_new = std::max(m[g], vhmax(vm));
    corr[g] = exp_neg(m[g] - m_new);
    vfloat sum = vfloat{};
    for (int jc = c_lo; jc < hi; jc += kLanes) {
      const vint key = lane + jc;
      const vfloat p = (key >= lo && key < hi) ? vexp_neg(vload(sg + jc) - m_new) : vfloat{};
      vstore(sg + jc, p);
      sum += p;
    }
    m[g] = m_new;
    l[g] = l[g] * corr[g] + vsum(sum);
  }
  pv_tile<D, NQ>(s, ss, v, v_next, lo, hi, corr, o);
}

// attend_group for a run of nq query vectors, three at a time (4 keys x 3 queries: 12
// score registers); the first three prefetch the next block's rows.
template <int D, typename KT>
inline void attend_queries(int nq, const float* q, const KT* k, const KT* v, const KT* k_next, const KT* v_next,
                           int bs, int ss, int lo, int hi, float cap, float* s, float* m, float* l, float* o) {
  for (int g = 0; g < nq; g += 3) {
    const int at = g * D;
    const KT* kn = g == 0 ? k_next : nullptr;
    const KT* vn = g == 0 ? v_next : nullptr;
    switch (std::min(3, nq - g)) {
      case 3: attend_group<D, 3>(q + at, k, v, kn, vn, bs, ss, lo, hi, cap, s, m + g, l + g, o + at); break;
      case 2: attend_group<D, 2>(q + at, k, v, kn, vn, bs, ss, lo, hi, cap, s, m + g, l + g, o + at); break;
      default: attend_group<D, 1>(q + at, k, v, kn, vn, bs, ss, lo, hi, cap, s, m + g, l + g, o + at); break;
    }
  }
}

// ---- prefill tiles: a tile's query vectors across the vector lanes (attend_item_lanes) --
template <int D>
struct LaneTile {
  // Output rows accumulated per pass of P.V: as many as fit ~16 vector registers.
  static constexpr int kRowsPerPass = std::max(1, 16 / (D / kLanes));
};

template <int D>
inline void lanes_chunk(const float* __restrict__ qt, const float* __restrict__ kb, const float* __restrict__ vb,
                        int jc, int nj, int j0, vint pos, int window, float cap, vfloat& m, vfloat& l,
                        float* __restrict__ acc, int lanes_used, float* __restrict__ pbuf) {
  // Scores of keys jc .. jc + kLanes of the block (rows past nj are masked below).
  vfloat s[kLanes];
  for (int j = 0; j < kLanes; ++j) s[j] = vfloat{};
  for (int i = 0; i < D; ++i) {
    const vfloat q = vload(qt + i * kLanes);
    for (int j = 0; j < kLanes; ++j) s[j] += q * kb[(jc + j) * D + i];
  }
  if (cap > 0.0f)
    for (int j = 0; j < kLanes; ++j) s[j] = cap * vtanh(s[j] / cap);
  vfloat cmax = m;
  vint valid[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const int kp = j0 + jc + j;
    vint ok = vint{} + kp <= pos;
    if (window > 0) ok &= vint{} + kp > pos - window;
    if (j >= nj) ok = vint{};
    valid[j] = ok;
    s[j] = ok ? s[j] : vsplat(kNegBig);
    cmax = vmax(cmax, s[j]);
  }
  const vfloat corr = vexp_neg(m - cmax);
  vfloat sum = vfloat{};
  for (int j = 0; j < kLanes; ++j) {
    const vfloat pj = valid[j] ? vexp_neg(s[j] - cmax) : vfloat{};
    sum += pj;
    vstore(pbuf + j * kLanes, pj);
  }
  m = cmax;
  l = l * corr + sum;
  float cs[kLanes];
  vstore(cs, corr);
  constexpr int V = D / kLanes, R = LaneTile<D>::kRowsPerPass;
  for (int k0 = 0; k0 < lanes_used; k0 += R) {
    const int nr = std::min(R, lanes_used - k0);
    vfloat o[R][V];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < V; ++c) o[r][c] = r < nr ? vload(acc + (k0 + r) * D + c * kLanes) * cs[k0 + r] : vfloat{};
    for (int j = 0; j < nj; ++j) {
      const float* __restrict__ v = vb + (jc + j) * D;
      vfloat vr[V];
      for (int c = 0; c < V; ++c) vr[c] = vload(v + c * kLanes);
      for (int r = 0; r < R; ++r) {
        const float p = pbuf[j * kLanes + k0 + r];  // lanes past lanes_used hold 0
        for (int c = 0; c < V; ++c) o[r][c] += vr[c] * p;
      }
    }
    for (int r = 0; r < nr; ++r)
      for (int c = 0; c < V; ++c) vstore(acc + (k0 + r) * D + c * kLanes, o[r][c]);
  }
}

}  // namespace pagedserve_cpu::attention
