// RankThreads (cluster/expert_parallel.h): no MPI call, so in the builds without MPI too.
#include <algorithm>
#include <thread>

#include "cluster/expert_parallel.h"
#include "platform/parallel.h"

namespace m3::cluster {

int RankThreads(const Group& group, int requested) {
  if (requested > 0) return ResolveThreadCount(requested);
  const int local = std::max(1, group.ranks_on_node());
  const int cpus = ResolveThreadCount(0);
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, std::min(cpus, hw / local));
}

}  // namespace m3::cluster
