// The one parallel-for of the engine (OpenMP underneath). Work is split into contiguous chunks of
// indices; every index is computed by exactly one thread with a fixed reduction order inside it,
// so results are bit-identical for any thread count.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstddef>

namespace m3 {

struct ThreadConfig {
  int threads = 1;
};

inline int DefaultThreadCount() { return std::max(1, omp_get_num_procs()); }

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

}  // namespace m3
