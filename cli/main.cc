// m3: MiniMax-M3 inference on CPUs.
#include <cstdio>
#include <exception>
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

}  // namespace

int main(int argc, char** argv) {
  // Started by mpirun with several ranks (docs/DIST.md): rank 0 runs the command, the others
  // follow its engines, computing their slices of the experts, until it is done.
  auto group = m3::cluster::Group::JoinIfLaunched(&argc, &argv);
  if (!group.ok()) {
    std::fprintf(stderr, "m3: %s\n", group.status().ToString().c_str());
    return 1;
  }
  if (*group) {
    (*group)->OnFailure([](const m3::Status& s) { std::fprintf(stderr, "m3: %s\n", s.message().c_str()); });
    if ((*group)->rank() != 0) return m3::cluster::RunFollower(**group);
  }
  const int rc = RunCommand(argc, argv);
  if (*group) m3::cluster::EndJob(**group);
  return rc;
}
