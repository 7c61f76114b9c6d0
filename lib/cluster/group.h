// The processes of one m3 job started by mpirun (expert parallelism, docs/DIST.md): their ranks
// and hosts, and a watchdog that ends every one of them, with an error naming the lost rank and its
// host, when one stops answering (killed, hung, cut off): never a hang.
//
// Rank 0 runs the command (and the HTTP server, the scheduler, the dense part of every pass); the
// others are followers: they open the same model, hold a slice of every expert and compute it
// when rank 0 asks (cluster/expert_parallel.h). MPI (Open MPI from Debian) carries everything.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"

namespace m3::cluster {

class Group {
 public:
  // Joins the MPI job when the environment says this process is one of several ranks that mpirun
  // (or another MPI launcher) started; null when it is alone. Call once, from main, before any
  // other thread starts. An error when it was launched so but this build has no MPI, or MPI fails.
  static StatusOr<std::unique_ptr<Group>> JoinIfLaunched(int* argc, char*** argv);
  // Whether this process was started by an MPI launcher (with any number of ranks).
  static bool Launched();
  // The joined group of this process, or null.
  static Group* Current();

  ~Group();  // ends the watchdog and MPI
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& host(int rank) const { return hosts_[static_cast<size_t>(rank)]; }
  std::string Describe(int rank) const;  // "rank 1 (host node7)"
  // What the watchdog reports on a lost rank, before it stops the job after `grace_s` (rank 0's
  // server turns new requests away meanwhile). Set before the first call that can block.
  void OnFailure(std::function<void(const Status&)> fn);
  // Silence after which a rank counts as lost (default 5 s; heartbeats go every 0.25 s).
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }
  // Ends the job at once from anywhere: every rank stops (MPI_Abort), after `message` on stderr.
  [[noreturn]] void Abort(const std::string& message) const;

  // The MPI side (cluster/mpi_group.h; mpi.h stays inside lib/cluster).
  struct Mpi;
  Mpi& mpi() const { return *mpi_; }

 private:
  Group();
  void Watch();  // the watchdog thread's loop
  [[noreturn]] void Lost(int rank, double silent_s);

  int rank_ = 0, size_ = 1;
  std::vector<std::string> hosts_;
  double timeout_s_ = 5.0;
  std::unique_ptr<Mpi> mpi_;
};

}  // namespace m3::cluster
