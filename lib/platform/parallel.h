// The one parallel-for of the engine (OpenMP underneath). Work is split into contiguous chunks of
// indices; every index is computed by exactly one thread with a fixed reduction order inside it,
// so results are bit-identical for any thread count.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace m3 {

struct ThreadConfig {
  int threads = 1;
};

inline int DefaultThreadCount() { return std::max(1, omp_get_num_procs()); }

// The threads to run with when `requested` are asked for: 0 (or less) means all CPUs this process
// may run on, and more than those are capped to them. Every parallel region ends at a barrier,
// so an oversubscribed thread makes the others wait while it is descheduled (a 1-token prompt
// of golden s1 took 5.7 s with 9999 threads on 2 CPUs, instead of 1 ms).
inline int ResolveThreadCount(int requested) {
  const int cpus = DefaultThreadCount();
  return requested <= 0 ? cpus : std::min(requested, cpus);
}

// Calls fn(begin, end, thread_index) over [0, n) in chunks of at least `grain` indices.
template <class Fn>
void ParallelFor(const ThreadConfig& tc, size_t n, size_t grain, Fn&& fn) {
  if (n == 0) return;
  grain = std::max<size_t>(grain, 1);
  const size_t max_chunks = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<size_t>(std::max(tc.threads, 1), max_chunks));
  if (threads <= 1) {
    fn(size_t{0}, n, 0);
    return;
  }
  // Static split: chunk c covers [c*n/threads, (c+1)*n/threads).
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    const int nt = omp_get_num_threads();
    const size_t begin = n * static_cast<size_t>(t) / static_cast<size_t>(nt);
    const size_t end = n * static_cast<size_t>(t + 1) / static_cast<size_t>(nt);
    if (begin < end) fn(begin, end, t);
  }
}

// Runs fn(thread_index, num_threads, barrier) once on every thread of one parallel region, for
// operators that run several dependent phases with a barrier between them instead of one region
// per phase (the MoE layer). barrier() must be reached by every thread the same number of times.
template <class Fn>
void ParallelRegion(const ThreadConfig& tc, Fn&& fn) {
  const int threads = std::max(tc.threads, 1);
  if (threads == 1) {
    fn(0, 1, [] {});
    return;
  }
#pragma omp parallel num_threads(threads)
  fn(omp_get_thread_num(), omp_get_num_threads(), [] {
#pragma omp barrier
  });
}

// Calls fn(j, begin, end) for the units of each job whose cost point falls in [c0, c1): job j has
// units[j] units of unit_cost[j] each, laid end to end, and unit i of job j sits at the cost
// point (cost before job j) + i * unit_cost[j]. Ranges that tile [0, total) give every unit to
// exactly one of them.
template <class Fn>
void ForEachUnitInCostRange(const std::vector<size_t>& units, const std::vector<uint64_t>& unit_cost, uint64_t c0,
                            uint64_t c1, Fn&& fn) {
  auto ceil_div = [](uint64_t a, uint64_t b) { return (a + b - 1) / b; };
  uint64_t start = 0;  // cost before job j
  for (size_t j = 0; j < units.size() && start < c1; ++j) {
    const uint64_t u = unit_cost[j], end = start + units[j] * u;
    if (u > 0 && end > c0 && start < c1) {
      const size_t b = c0 > start ? static_cast<size_t>(ceil_div(c0 - start, u)) : 0;
      const size_t e = c1 >= end ? units[j] : static_cast<size_t>(ceil_div(c1 - start, u));
      if (b < e) fn(j, b, e);
    }
    start = end;
  }
}

inline uint64_t TotalCost(const std::vector<size_t>& units, const std::vector<uint64_t>& unit_cost) {
  uint64_t total = 0;
  for (size_t j = 0; j < units.size(); ++j) total += units[j] * unit_cost[j];
  return total;
}

// Work split by cost: job j has units[j] units of unit_cost[j] each (row tiles times tokens, say).
// Calls fn(j, begin, end) for the units of each job inside this thread's share: contiguous
// shares of equal total cost, so one expensive job (an expert that took most tokens) is spread
// over every thread instead of serialized on one. Every unit goes to exactly one thread, and
// which one depends only on the costs and the thread count.
template <class Fn>
void ForEachShare(const std::vector<size_t>& units, const std::vector<uint64_t>& unit_cost, int thread, int threads,
                  Fn&& fn) {
  const uint64_t total = TotalCost(units, unit_cost);
  const auto t = static_cast<uint64_t>(thread), nt = static_cast<uint64_t>(threads);
  ForEachUnitInCostRange(units, unit_cost, total * t / nt, total * (t + 1) / nt, fn);
}

// The same units handed out while the threads run: each thread takes the next piece of about
// total / (threads x kPiecesPerThread) cost from `cursor` (0 before the region, shared by its
// threads) until none is left. For memory-bound work whose threads do not read at the same
// speed (another tenant, a busier memory channel, an interrupt): a static share leaves the fast
// ones waiting at the barrier for the slowest, here they take its pieces. Every unit still goes
// to exactly one thread and is computed whole by it, so the results do not depend on who did what.
inline constexpr uint64_t kPiecesPerThread = 8;
template <class Fn>
void ForEachDynamicShare(const std::vector<size_t>& units, const std::vector<uint64_t>& unit_cost, int threads,
                         std::atomic<uint64_t>& cursor, Fn&& fn) {
  const uint64_t total = TotalCost(units, unit_cost);
  const uint64_t piece = std::max<uint64_t>(1, total / (static_cast<uint64_t>(std::max(threads, 1)) * kPiecesPerThread));
  for (;;) {
    const uint64_t c0 = cursor.fetch_add(piece, std::memory_order_relaxed);
    if (c0 >= total) return;
    ForEachUnitInCostRange(units, unit_cost, c0, std::min(total, c0 + piece), fn);
  }
}

}  // namespace m3
