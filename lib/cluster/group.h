// The processes of one m3 job started by mpirun (expert parallelism, docs/DIST.md): their ranks
// and hosts, and a watchdog that notices a rank that stops answering (killed, hung, cut off) and
// reports it, naming the rank and its host, so that the program can end the job: never a hang.
//
// Rank 0 runs the command (and the HTTP server, the scheduler, the dense part of every pass); the
// others are followers: they open the same model, hold a slice of every expert and compute it
// when rank 0 asks (cluster/expert_parallel.h). MPI (Open MPI from Debian) carries everything.
// Nothing here is global, reads the environment, prints or ends the process: the program joins
// the job, gives the group to its engines (EngineOptions::group) and decides what a lost rank means.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

namespace m3::cluster {

// What the launcher told this process, from its environment (the program reads it).
struct LaunchInfo {
  // Ranks the MPI launcher started (OMPI_COMM_WORLD_SIZE, or PMI_SIZE, PMIX_SIZE, MPI_LOCALNRANKS
  // of other launchers); 0: not started by one.
  int ranks = 0;
  int ranks_on_node = 1;   // of them on this node (OMPI_COMM_WORLD_LOCAL_SIZE)
  std::string transports;  // Open MPI's byte transports, `mpirun --mca btl ...` (OMPI_MCA_btl); "": its default
  double timeout_s = 5.0;  // silence after which a rank counts as lost (M3_DIST_TIMEOUT)
};

class Group {
 public:
  // Joins the MPI job when `launch` says this process is one of several ranks that mpirun (or
  // another MPI launcher) started; null when it is alone. Call once, from main, before any other
  // thread starts. An error when MPI fails or cannot serve several threads.
  static StatusOr<std::unique_ptr<Group>> JoinIfLaunched(const LaunchInfo& launch, int* argc, char*** argv);

  ~Group();  // ends the watchdog and MPI
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int ranks_on_node() const { return launch_.ranks_on_node; }
  const std::string& transports() const { return launch_.transports; }
  const std::string& host(int rank) const { return hosts_[static_cast<size_t>(rank)]; }
  std::string Describe(int rank) const;  // "rank 1 (host node7)"
  // Called once, from the watchdog thread, when a rank is lost: an Unavailable status naming it and
  // its host. The group then stays unusable (Health()); a call blocked on the lost rank returns
  // only when the job ends, so the program ends it (AbortJob). Set before the first call that can block.
  void OnFailure(std::function<void(const Status&)> fn);
  // Ok, or the status of the lost rank once the watchdog has reported one: what every later
  // exchange returns.
  Status Health() const;
  // Silence after which a rank counts as lost (heartbeats go every 0.25 s).
  double timeout() const { return launch_.timeout_s; }
  // Ends every rank of the job at once (MPI_Abort with `code`); prints nothing. Returns only if MPI
  // could not end it.
  void AbortJob(int code) const;

  // The MPI side (cluster/mpi_group.h; mpi.h stays inside lib/cluster).
  struct Mpi;
  Mpi& mpi() const { return *mpi_; }

 private:
  explicit Group(const LaunchInfo& launch);
  void Watch();  // the watchdog thread's loop
  void Lost(int rank, double silent_s);

  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;
  LaunchInfo launch_;
  std::unique_ptr<Mpi> mpi_;
};

}  // namespace m3::cluster
