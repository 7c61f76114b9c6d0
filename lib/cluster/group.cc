#include "cluster/group.h"

#include <pthread.h>

#include <chrono>
#include <csignal>
#include <climits>
#include <cstring>
#include <thread>

#include "cluster/mpi_group.h"

namespace m3::cluster {
namespace {

constexpr int kBeatTag = 7;
constexpr double kBeatInterval_s = 0.25;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

StatusOr<int> MpiCount(size_t n, const char* what) {
  if (n > static_cast<size_t>(INT_MAX))
    return OutOfRange(what, ": ", n, " values are more than one MPI message carries (", INT_MAX,
                      "): use a smaller --prefill-chunk");
  return static_cast<int>(n);
}

Group::Group(const LaunchInfo& launch) : launch_(launch), mpi_(std::make_unique<Mpi>()) {}

StatusOr<std::unique_ptr<Group>> Group::JoinIfLaunched(const LaunchInfo& launch, int* argc, char*** argv) {
  if (launch.ranks <= 1) return std::unique_ptr<Group>();
  if (!(launch.timeout_s > 0))
    return InvalidArgument("the timeout of a lost rank must be > 0 s, got ", launch.timeout_s);
  // MPI's own threads and the watchdog never take SIGTERM or SIGINT: those stay with the
  // program's threads (m3 serve's drain waits for them), so they are blocked while those start.
  sigset_t stop, before;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, &before);
  struct Restore {
    sigset_t mask;
    ~Restore() { pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } restore{before};
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
    return IoError("MPI_Init_thread failed");
  // The watchdog thread sends heartbeats while another thread runs passes.
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    return Unsupported("this MPI library does not allow MPI calls from several threads (MPI_THREAD_MULTIPLE)");
  }
  std::unique_ptr<Group> g(new Group(launch));
  MPI_Comm_rank(MPI_COMM_WORLD, &g->rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &g->size_);
  MPI_Comm_dup(MPI_COMM_WORLD, &g->mpi_->work);
  MPI_Comm_dup(MPI_COMM_WORLD, &g->mpi_->beat);
  MPI_Comm_set_errhandler(g->mpi_->beat, MPI_ERRORS_RETURN);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  std::vector<char> all(static_cast<size_t>(g->size_) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, g->mpi_->work);
  for (int r = 0; r < g->size_; ++r) {
    const char* h = all.data() + static_cast<size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    g->hosts_.emplace_back(h, strnlen(h, MPI_MAX_PROCESSOR_NAME));
  }
  Group* raw = g.get();
  g->mpi_->watchdog = std::thread([raw] { raw->Watch(); });
  return g;
}

Group::~Group() {
  // All ranks meet with their watchdogs still beating (one may take long to get here), then stop
  // them; every rank has stopped beating once all meet again: take what is left, then finish.
  MPI_Barrier(mpi_->work);
  mpi_->stop = true;
  if (mpi_->watchdog.joinable()) mpi_->watchdog.join();
  MPI_Barrier(mpi_->beat);
  int flag = 1;
  while (flag) {
    MPI_Status st;
    MPI_Iprobe(MPI_ANY_SOURCE, kBeatTag, mpi_->beat, &flag, &st);
    if (flag) {
      int tick = 0;
      MPI_Recv(&tick, 1, MPI_INT, st.MPI_SOURCE, kBeatTag, mpi_->beat, MPI_STATUS_IGNORE);
    }
  }
  MPI_Comm_free(&mpi_->beat);
  MPI_Comm_free(&mpi_->work);
  MPI_Finalize();
}

std::string Group::Describe(int rank) const { return Str("rank ", rank, " (host ", host(rank), ")"); }

void Group::OnFailure(std::function<void(const Status&)> fn) {
  std::lock_guard<std::mutex> lock(mpi_->mu);
  mpi_->on_failure = std::move(fn);
}

Status Group::Health() const {
  std::lock_guard<std::mutex> lock(mpi_->mu);
  return mpi_->lost;
}

void Group::AbortJob(int code) const { MPI_Abort(MPI_COMM_WORLD, code); }

void Group::Lost(int rank, double silent_s) {
  const Status lost(StatusCode::kUnavailable,
                    Str(Describe(rank), " has not answered for ", static_cast<int>(silent_s * 10) / 10.0,
                        " s (killed, hung or cut off from the network)"));
  std::function<void(const Status&)> fn;
  {
    std::lock_guard<std::mutex> lock(mpi_->mu);
    if (!mpi_->lost.ok()) return;  // reported once
    mpi_->lost = lost;
    fn = mpi_->on_failure;
  }
  if (fn) fn(lost);
}

// Heartbeats: rank 0 and each follower send each other one every 0.25 s (rank 0 watches every
// follower, a follower rank 0). They come from this thread whatever the others are doing (a long
// pass, a wait in a collective), so silence means the process is gone, stopped or unreachable.
void Group::Watch() {
  std::vector<int> peers;
  if (rank_ == 0) {
    for (int r = 1; r < size_; ++r) peers.push_back(r);
  } else {
    peers.push_back(0);
  }
  const size_t n = peers.size();
  std::vector<MPI_Request> recv(n, MPI_REQUEST_NULL);
  std::vector<int> in(n, 0);
  std::vector<double> last(n, Now());
  for (size_t i = 0; i < n; ++i) MPI_Irecv(&in[i], 1, MPI_INT, peers[i], kBeatTag, mpi_->beat, &recv[i]);
  static const int tick = 1;  // outlives the sends freed unfinished
  double next_beat = 0;
  while (!mpi_->stop) {
    const double now = Now();
    if (now >= next_beat) {
      for (int peer : peers) {
        MPI_Request req;
        if (MPI_Isend(&tick, 1, MPI_INT, peer, kBeatTag, mpi_->beat, &req) == MPI_SUCCESS) MPI_Request_free(&req);
      }
      next_beat = now + kBeatInterval_s;
    }
    for (size_t i = 0; i < n; ++i) {
      int done = 0;
      while (MPI_Test(&recv[i], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
        last[i] = Now();
        MPI_Irecv(&in[i], 1, MPI_INT, peers[i], kBeatTag, mpi_->beat, &recv[i]);
      }
      if (Now() - last[i] > launch_.timeout_s) Lost(peers[i], Now() - last[i]);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (MPI_Request& r : recv) {
    MPI_Cancel(&r);
    MPI_Wait(&r, MPI_STATUS_IGNORE);
  }
}

}  // namespace m3::cluster
