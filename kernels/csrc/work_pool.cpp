// The pool of work_pool.h: one per process, started at its first call, restarted in a
// forked child (threads do not survive fork).
//
// A call is a job: its function, context and chunk count, published under one 64-bit
// word, `state` = epoch << 32 | the next chunk to take. Taking a chunk is a
// compare-and-swap on that word, so a chunk is taken once and only by a thread that
// read the job's fields for that same epoch: a new job first closes the word (next =
// kClosed, no chunk can be taken), then writes its fields, then opens it at chunk 0,
// and a helper checks the word again after reading the fields (a seqlock). The caller
// returns once `done` counts every chunk, after which no helper touches its context.
//
// Ops (torch.ops.pagedserve_cpu): work_pool_info() -> [helpers, enabled, running
// helpers, chunks the helpers ran, times the calls went alone after a slow helper]; work_pool_enable(bool) -> bool (was it on);
// work_pool_chunk(weights) -> the previous weights per chunk (0: leave it).

#include "work_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using pagedserve_cpu::pool::ChunkFn;

constexpr uint64_t kIndexMask = 0xFFFFFFFFu;
constexpr uint64_t kClosed = kIndexMask;  // no chunk can be taken: a job is being written
constexpr int kMaxHelpers = 7;            // beyond ~8 threads a decode's GEMV is memory-bound
// A helper spins this long after a call before it parks: through the gaps between a
// step's kernels and most of the gap between two decode steps of one stream. Parked, it
// took 50-100 us to wake at each step's first calls and again after any gap it slept
// through, by when a small GEMV was done without it: one stream's served ITL was 15.6 ms
// with a 100 us spin, 12.6 with 5 ms (Q4_1, 2-core EPYC, side by side; llama.cpp 10.7).
// Since steps stream (a shorter gap), spinning through all of it holds the core the
// scheduler and the gateway need then: side by side on a 2-core AVX-512 EPYC, one stream,
// 1 ms against 5 ms: Q8_0 int8 9.05 / 9.58 / 9.79 against 9.38 / 10.19 / 9.88 ms (three
// runs), Q4_1 fp32 11.04 against 11.42; 0.5 and 2 ms within the noise of 1.
constexpr int64_t kDefaultSpinUs = 1000;
// Weights per chunk, ~15 us of a fused quantized tile: each chunk is a fresh stream for
// the hardware prefetcher, so shorter ones read the weights slower (one stream's step:
// 10.4 ms at 2^15, 9.1 at 2^17, 9.8 at 2^19); the threads still end within a chunk.
constexpr int64_t kDefaultChunkWork = int64_t{1} << 17;
// A chunk takes a few us: a helper that has not finished one in this long is
// descheduled. Until then the caller spins: asleep, its (virtual) core would take
// 50-100 us to wake (measured: a 20 us spin cost a 33 ms step 7 ms).
constexpr auto kWaitBeforeSleep = std::chrono::microseconds(100);
// A caller that slept this long for a helper's chunk found the helper descheduled for a
// scheduler's time slice: on a machine whose cores are all busy, every call would pay
// that for a few us of help, so the calls run alone for a while, twice as long after
// each such wait in a row (at most kMaxBackoff), and try the helpers again. Shorter
// waits are the serving processes' brief turns on the helper's core (at 100 us, one
// stream's calls went alone for much of each step: served ITL 15.2 vs 12.5 ms at 1 ms).
constexpr auto kSlowWait = std::chrono::milliseconds(1);
constexpr auto kFirstBackoff = std::chrono::milliseconds(10);
constexpr auto kMaxBackoff = std::chrono::milliseconds(1000);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::strtoll(v, nullptr, 10);
}

// The cores this process may run on, but one (the caller's), capped.
int helpers_for_affinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 0;
  return std::max(0, std::min(kMaxHelpers, CPU_COUNT(&set) - 1));
}

thread_local bool t_helper = false;

class Pool {
 public:
  Pool()
      : helpers_(helpers_for_affinity()),
        spin_(std::chrono::microseconds(std::max<int64_t>(0, env_int("PAGEDSERVE_WORK_POOL_SPIN_US", kDefaultSpinUs)))),
        enabled_(env_int("PAGEDSERVE_WORK_POOL", 1) != 0) {}

  bool usable() const {
    return helpers_ > 0 && enabled_.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now().time_since_epoch().count() >= alone_until_.load(std::memory_order_relaxed);
  }
  bool set_enabled(bool on) { return enabled_.exchange(on); }
  int helpers() const { return helpers_; }
  int64_t chunk_work() const { return chunk_work_.load(std::memory_order_relaxed); }
  int64_t set_chunk_work(int64_t weights) { return weights > 0 ? chunk_work_.exchange(weights) : chunk_work(); }
  std::vector<int64_t> info() const {
    return {helpers_, enabled_.load() ? 1 : 0, running_.load(), helper_chunks_.load(), backoffs_.load()};
  }

  void run(int64_t n, int64_t grain, ChunkFn fn, const void* ctx) {
    if (busy_.exchange(true, std::memory_order_acquire)) {  // another thread's call holds the pool
      fn(ctx, 0, n);
      return;
    }
    if (running_.load(std::memory_order_relaxed) == 0) start();
    caller_cpu_.store(sched_getcpu(), std::memory_order_relaxed);
    const uint32_t epoch = static_cast<uint32_t>(state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(static_cast<uint64_t>(epoch) << 32 | kClosed, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    grain_.store(grain, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(epoch) << 32, std::memory_order_seq_cst);
    wake_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(wake_);
    work(state_.load(std::memory_order_relaxed), epoch, fn, ctx, n, grain);
    const auto waited = wait_done(static_cast<uint32_t>((n + grain - 1) / grain));
    if (waited > kSlowWait) {
      const auto now = std::chrono::steady_clock::now();
      alone_until_.store((now + backoff_).time_since_epoch().count(), std::memory_order_relaxed);
      backoff_ = std::min<std::chrono::nanoseconds>(2 * backoff_, kMaxBackoff);
      backoffs_.fetch_add(1, std::memory_order_relaxed);
    } else {
      backoff_ = kFirstBackoff;
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  // Sleeps until `word` moves on from `seen` (at once if it already has).
  static void futex_wait(std::atomic<uint32_t>& word, uint32_t seen) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
  }
  static void futex_wake_all(std::atomic<uint32_t>& word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  void start() {
    for (int i = 0; i < helpers_; ++i) {
      std::thread([this] { helper(); }).detach();  // parked at exit: the process ends them
      running_.fetch_add(1);
    }
  }

  // Every chunk is taken: waits for those a helper is still running. Spinning for a while
  // (not at all where the helper shares this core), then asleep: a helper descheduled
  // mid-chunk (its core taken by the scheduler or the gateway) is then pulled onto this
  // idle core by the kernel's load balancing, where a spinning or yielding caller would
  // keep it waiting for its own core (milliseconds). Returns how long it waited.
  std::chrono::nanoseconds wait_done(uint32_t chunks) {
    const auto since = std::chrono::steady_clock::now();
    for (int i = 1; done_.load(std::memory_order_acquire) < chunks; ++i) {
      cpu_relax();
      if (i % 64 == 0 && (std::chrono::steady_clock::now() - since > kWaitBeforeSleep ||
                          helper_cpu_.load(std::memory_order_relaxed) == caller_cpu_.load(std::memory_order_relaxed)))
        break;
    }
    for (;;) {
      const uint32_t done = done_.load(std::memory_order_seq_cst);
      if (done >= chunks) break;
      caller_asleep_.store(true, std::memory_order_seq_cst);
      if (done_.load(std::memory_order_seq_cst) == done) futex_wait(done_, done);
      caller_asleep_.store(false, std::memory_order_relaxed);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    return std::chrono::steady_clock::now() - since;
  }

  // Takes and runs the chunks of job `epoch` from state `s` on; the chunks it ran.
  int64_t work(uint64_t s, uint32_t epoch, ChunkFn fn, const void* ctx, int64_t n, int64_t grain) {
    const uint64_t chunks = static_cast<uint64_t>((n + grain - 1) / grain);
    int64_t ran = 0;
    while ((s >> 32) == epoch && (s & kIndexMask) < chunks) {
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
      const int64_t c = static_cast<int64_t>(s & kIndexMask);
      fn(ctx, c * grain, std::min(n, (c + 1) * grain));
      done_.fetch_add(1, std::memory_order_seq_cst);
      if (caller_asleep_.load(std::memory_order_seq_cst)) futex_wake_all(done_);
      ++ran;
      s = state_.load(std::memory_order_relaxed);
    }
    return ran;
  }

  void helper() {
    t_helper = true;
    pthread_setname_np(pthread_self(), "ps-work-pool");
    uint32_t seen = static_cast<uint32_t>(state_.load(std::memory_order_acquire) >> 32);
    for (;;) {
      const uint64_t s = next_job(seen);
      const uint32_t epoch = static_cast<uint32_t>(s >> 32);
      if ((s & kIndexMask) == kClosed) {  // its fields are being written
        cpu_relax();
        continue;
      }
      const ChunkFn fn = fn_.load(std::memory_order_relaxed);
      const void* ctx = ctx_.load(std::memory_order_relaxed);
      const int64_t n = n_.load(std::memory_order_relaxed), grain = grain_.load(std::memory_order_relaxed);
      std::atomic_thread_fence(std::memory_order_acquire);
      const uint64_t again = state_.load(std::memory_order_relaxed);
      if ((again >> 32) != epoch || (again & kIndexMask) == kClosed) continue;  // a newer job: read that one
      seen = epoch;
      helper_cpu_.store(sched_getcpu(), std::memory_order_relaxed);
      helper_chunks_.fetch_add(work(again, epoch, fn, ctx, n, grain), std::memory_order_relaxed);
    }
  }

  // The state once its epoch is not `seen`: spinning for spin_ (until it finds itself on
  // the caller's core), then parked.
  uint64_t next_job(uint32_t seen) {
    const auto since = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      const uint64_t s = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(s >> 32) != seen) return s;
      cpu_relax();
      if (i % 64 == 0 && (std::chrono::steady_clock::now() - since > spin_ ||
                          sched_getcpu() == caller_cpu_.load(std::memory_order_relaxed)))
        break;
    }
    for (;;) {
      const uint32_t ticket = wake_.load(std::memory_order_seq_cst);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (static_cast<uint32_t>(state_.load(std::memory_order_seq_cst) >> 32) == seen)
        futex_wait(wake_, ticket);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      const uint64_t s = state_.load(std::memory_order_acquire);
      if (static_cast<uint32_t>(s >> 32) != seen) return s;
    }
  }

  const int helpers_;
  const std::chrono::nanoseconds spin_;
  std::atomic<bool> enabled_;
  std::atomic<int64_t> chunk_work_{kDefaultChunkWork};
  std::atomic<bool> busy_{false};
  std::atomic<int> running_{0};
  std::atomic<int64_t> helper_chunks_{0};
  std::atomic<int64_t> backoffs_{0};
  std::atomic<std::chrono::steady_clock::rep> alone_until_{0};  // steady_clock ticks
  std::chrono::nanoseconds backoff_{kFirstBackoff};             // the caller's (busy_ held)
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<uint32_t> done_{0};  // chunks finished (a futex word: 32 bits)
  std::atomic<bool> caller_asleep_{false};
  // The cores the last call and the helper's last job started on (sched_getcpu). Where the
  // other cores are busy (in serving: the scheduler, the gateway, the client), the kernel
  // may run both on one core: a spin there only holds the core the other one needs, so
  // neither spins while they share it (served one-stream forward ~6 % faster, measured
  // with bench.itl_split round by round).
  std::atomic<int> caller_cpu_{-1}, helper_cpu_{-2};
  alignas(64) std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0}, grain_{1};
  alignas(64) std::atomic<uint32_t> wake_{0};
  std::atomic<int> sleepers_{0};
};

std::atomic<Pool*> g_pool{nullptr};

// A forked child has none of the parent's helpers: it makes its own pool at its first
// call (the parent's is left as it is, never freed: its helpers may still run there).
void forget_pool_in_child() { g_pool.store(nullptr); }

Pool& the_pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  static const int registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  (void)registered;
  auto* fresh = new Pool();  // never freed: helpers may outlive static destruction at exit
  if (g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *p;
}

std::vector<int64_t> work_pool_info() { return the_pool().info(); }

bool work_pool_enable(bool on) { return the_pool().set_enabled(on); }

int64_t work_pool_chunk(int64_t weights) { return the_pool().set_chunk_work(weights); }

}  // namespace

namespace pagedserve_cpu::pool {

bool usable() {
  return !t_helper && at::get_num_threads() == 1 && !at::in_parallel_region() && the_pool().usable();
}

int64_t chunk_work() { return the_pool().chunk_work(); }

int team() { return usable() ? 1 + the_pool().helpers() : 1; }

void run(int64_t n, int64_t grain, ChunkFn fn, const void* ctx) { the_pool().run(n, grain, fn, ctx); }

}  // namespace pagedserve_cpu::pool

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("work_pool_info() -> int[]", &work_pool_info);
  m.def("work_pool_enable(bool on) -> bool", &work_pool_enable);
  m.def("work_pool_chunk(int weights) -> int", &work_pool_chunk);
}
