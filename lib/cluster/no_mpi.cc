// lib/cluster in a build without MPI (M3_MPI=OFF, or AUTO where libopenmpi-dev is missing, as in
// the aarch64 cross build: Debian's arm64 Open MPI cannot sit beside the amd64 one). A process is
// then always alone: JoinIfLaunched refuses a launch of several ranks by name, and since no Group
// can exist, the rest is never reached (defined for the linker only).
#include "cluster/expert_parallel.h"
#include "cluster/group.h"

namespace m3::cluster {

struct Group::Mpi {};

StatusOr<std::unique_ptr<Group>> Group::JoinIfLaunched(const LaunchInfo& launch, int*, char***) {
  if (launch.ranks <= 1) return std::unique_ptr<Group>();
  return Unsupported("started as one of ", launch.ranks,
                     " MPI ranks, but this m3 was built without MPI (install libopenmpi-dev and rebuild)");
}

Group::Group(const LaunchInfo& launch) : launch_(launch) {}
Group::~Group() = default;
std::string Group::Describe(int rank) const { return Str("rank ", rank); }
void Group::OnFailure(std::function<void(const Status&)>) {}
Status Group::Health() const { return Status::Ok(); }
void Group::AbortJob(int) const {}

namespace {
Status NoMpi() { return Unsupported("expert parallelism needs a build with MPI (libopenmpi-dev)"); }
}  // namespace

StatusOr<std::unique_ptr<ExpertParallel>> ExpertParallel::Start(Group&, const PartOptions&) { return NoMpi(); }
ExpertParallel::~ExpertParallel() = default;
Status ExpertParallel::Connect(const Model&) { return NoMpi(); }
Status ExpertParallel::Run(const OpContext&, int, const MoeWeights&, const MoeParams&, const float*, size_t, float*,
                           int32_t*) const {
  return NoMpi();
}
ExchangeStats ExpertParallel::stats() const { return stats_; }
void ExpertParallel::ResetStats() { stats_ = {}; }
StatusOr<std::pair<double, uint64_t>> ExpertParallel::ProbeExchange(size_t, int, MoeSplitKind) const {
  return NoMpi();
}
void ExpertParallel::ReadExpertsIn() const {}
std::string ExpertParallel::Describe() const { return "no MPI"; }
Status RunFollower(Group&, const OpenPartFn&) { return NoMpi(); }
void EndJob(Group&) {}

}  // namespace m3::cluster
