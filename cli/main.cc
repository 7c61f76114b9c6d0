// m3: MiniMax-M3 inference on CPUs.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <new>

#include "cli/commands.h"
#include "cluster/expert_parallel.h"

namespace {

int RunCommand(int argc, char** argv) {
  CLI::App app{"m3: MiniMax-M3 inference on CPUs"};
  app.require_subcommand(1);
  int rc = 0;
  m3::cli::AddInspectCommand(app, &rc);
  m3::cli::AddLogitsCommand(app, &rc);
  m3::cli::AddTextCommands(app, &rc);
  m3::cli::AddRunCommands(app, &rc);
  m3::cli::AddPackCommand(app, &rc);
  m3::cli::AddBenchCommand(app, &rc);
  m3::cli::AddServeCommand(app, &rc);
  m3::cli::AddBatchCommand(app, &rc);
  m3::cli::AddPerplexityCommand(app, &rc);
  m3::cli::AddImatrixCommand(app, &rc);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "m3: out of memory\n");
    return 1;
  } catch (const std::exception& e) {  // the library reports errors as Status; this is a last resort
    std::fprintf(stderr, "m3: internal error: %s\n", e.what());
    return 1;
  }
  return rc;
}

// What the MPI launcher said, from its environment (docs/DIST.md): the library reads none.
m3::cluster::LaunchInfo LaunchFromEnvironment() {
  m3::cluster::LaunchInfo launch;
  // The rank count of Open MPI, then of PMI / PMIx launchers.
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      launch.ranks = std::atoi(v);
      break;
    }
  }
  if (const char* v = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) launch.ranks_on_node = std::max(1, std::atoi(v));
  if (const char* v = std::getenv("OMPI_MCA_btl")) launch.transports = v;
  if (const char* v = std::getenv("M3_DIST_TIMEOUT")) {
    const double s = std::atof(v);
    if (s >= 0.5 && s <= 3600) launch.timeout_s = s;
  }
  return launch;
}

// A follower's part of the model: an Engine with its slice of the experts, which runs no pass.
class EnginePart : public m3::cluster::FollowerPart {
 public:
  explicit EnginePart(std::unique_ptr<m3::Engine> engine) : engine_(std::move(engine)) {}
  const m3::Model& model() const override { return engine_->model(); }
  const m3::ThreadConfig& threads() const override { return engine_->threads(); }
  const m3::Kernels& kernels() const override { return engine_->kernels(); }

 private:
  std::unique_ptr<m3::Engine> engine_;
};

// Opens what rank 0 asks of a follower: its part of rank 0's model, with rank 0's engine options.
m3::StatusOr<std::unique_ptr<m3::cluster::FollowerPart>> OpenEnginePart(m3::cluster::Group& group,
                                                                        const m3::cluster::PartOptions& o,
                                                                        const m3::MoePart& part) {
  m3::EngineOptions options;
  options.threads = o.threads;
  M3_ASSIGN_OR_RETURN(options.numa, m3::ParseNumaMode(o.numa));
  options.kernels = o.kernels;
  options.group = &group;
  options.expert_part = part;
  if (options.numa != m3::NumaMode::kOff) {
    M3_ASSIGN_OR_RETURN(options.simulated_numa_nodes, m3::cli::SimulatedNumaNodes());
  }
  M3_ASSIGN_OR_RETURN(std::unique_ptr<m3::Engine> engine, m3::Engine::Open(o.model_dir, options));
  return std::unique_ptr<m3::cluster::FollowerPart>(std::make_unique<EnginePart>(std::move(engine)));
}

// A follower's life (rank 1 and up): its slices of rank 0's MoE blocks until rank 0 is done.
int Follow(m3::cluster::Group& group) {
  const m3::Status s = m3::cluster::RunFollower(
      group,
      [&group](const m3::cluster::PartOptions& o, const m3::MoePart& part) { return OpenEnginePart(group, o, part); });
  if (s.ok()) return 0;
  // Rank 0 waits on this rank in an exchange: only ending the job frees it.
  std::fprintf(stderr, "m3: %s: %s\n", group.Describe(group.rank()).c_str(), s.ToString().c_str());
  std::fflush(stderr);
  group.AbortJob(1);
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Started by mpirun with several ranks (docs/DIST.md): rank 0 runs the command, the others
  // follow its engines, computing their slices of the experts, until it is done.
  auto group = m3::cluster::Group::JoinIfLaunched(LaunchFromEnvironment(), &argc, &argv);
  if (!group.ok()) {
    std::fprintf(stderr, "m3: %s\n", group.status().ToString().c_str());
    return 1;
  }
  if (*group) {
    m3::cli::StopJobOnLostRank(**group,
                               [](const m3::Status& s) { std::fprintf(stderr, "m3: %s\n", s.message().c_str()); });
    if ((*group)->rank() != 0) return Follow(**group);
    m3::cli::SetJobGroup(group->get());
  }
  const int rc = RunCommand(argc, argv);
  if (*group) {
    m3::cluster::EndJob(**group);
    m3::cli::SetJobGroup(nullptr);
  }
  return rc;
}
