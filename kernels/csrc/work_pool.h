// Dynamic work sharing for the weight-streaming kernels (quantized GEMV/GEMM, the packed
// linear) at small steps, where torch runs one thread (the thread plan leaves the other
// cores to the scheduler and the gateway: svc_common/cpu_features.py).
//
// A statically split parallel region (OpenMP, at::parallel_for) waits for its slowest
// thread, and on a 2-core machine the second core is often busy with the scheduler or
// the gateway for a few ms per token: two threads measured slower than one (issue 38).
// Here the items (groups of output rows) are cut into chunks handed out through one
// atomic counter. The calling thread always works; persistent helper threads (one per
// core the process may use, but one; started once; spinning a few ms after a call and
// then parked on a futex, so an idle pool keeps no core busy) take chunks when they are
// scheduled. A descheduled helper costs the caller only the chunk it has taken: the
// caller finishes every chunk nobody took and then waits for the taken ones (and where
// that wait was long, the calls go alone for a while: work_pool.cpp).
//
// Every item is computed by one thread exactly as a single thread computes it, so the
// results are the same bits with the pool on or off (tests/unit/test_work_pool.py).
//
// share_items takes the pool when torch's team is one thread and no parallel region is
// open; otherwise torch's team owns the cores and at::parallel_for splits as before.
// PAGEDSERVE_WORK_POOL=0 turns the pool off for the process (read when it starts);
// ops work_pool_enable(bool), work_pool_chunk(int) and work_pool_info() switch, tune and
// report it at run time (tests, bench/cpu/worker_step.py's side-by-side rounds).

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace pagedserve_cpu::pool {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Whether a call from this thread may take the pool now.
bool usable();

// Weights (x rows times weights) per chunk: by default ~4 us of a fused quantized tile,
// small enough that the threads end together, large enough that the counter's cache
// line moving between cores (~0.1-0.2 us) stays a few percent. Tests make it tiny so
// that a tiny model's calls are cut into many chunks.
int64_t chunk_work();

// The threads a call may share its chunks with: the caller and the helpers (1 where the
// pool is not usable from this thread).
int team();

// fn(ctx, begin, end) over [0, n) in chunks of `grain` items, on the caller and the
// helpers; returns when every chunk is done.
void run(int64_t n, int64_t grain, ChunkFn fn, const void* ctx);

}  // namespace pagedserve_cpu::pool

namespace pagedserve_cpu {

// f(begin, end) over the items [0, n), as at::parallel_for(0, n, 1, f) calls it;
// item_work: the weights (times rows of x) one item multiplies, which sizes the chunks.
template <typename F>
void share_items(int64_t n, int64_t item_work, const F& f) {
  if (n <= 0) return;
  if (n == 1 || !pool::usable()) {
    at::parallel_for(0, n, 1, f);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, pool::chunk_work() / std::max<int64_t>(1, item_work));
  pool::run(
      n, grain, [](const void* ctx, int64_t begin, int64_t end) { (*static_cast<const F*>(ctx))(begin, end); }, &f);
}

}  // namespace pagedserve_cpu
