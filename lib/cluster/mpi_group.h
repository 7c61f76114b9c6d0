// Inside lib/cluster: the MPI handles of a Group (cluster/group.h).
#pragma once

#include <mpi.h>

#include <atomic>
#include <functional>
#include <mutex>
#include <thread>

#include "cluster/group.h"

namespace m3::cluster {

struct Group::Mpi {
  MPI_Comm work = MPI_COMM_NULL;  // rank 0's commands, the payloads and the exchanges
  MPI_Comm beat = MPI_COMM_NULL;  // heartbeats, apart so that they never match work messages
  std::thread watchdog;
  std::atomic<bool> stop{false};
  std::mutex mu;  // guards the two below
  std::function<void(const Status&)> on_failure;
  Status lost;  // the first lost rank, once the watchdog saw one
};

// A count of elements for MPI (an int), or an error naming what was too large.
StatusOr<int> MpiCount(size_t n, const char* what);

}  // namespace m3::cluster
