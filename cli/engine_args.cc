#include "cli/commands.h"

namespace m3::cli {

StatusOr<EngineOptions> EngineArgs::Options() const {
  if (threads < 0) return InvalidArgument("-t must be >= 0 (0 = all cores), got ", threads);
  EngineOptions o;
  o.threads = threads;
  M3_ASSIGN_OR_RETURN(o.numa, ParseNumaMode(numa));
  o.mlock_dense = mlock_dense;
  return o;
}

void AddEngineOptions(CLI::App* cmd, EngineArgs* args) {
  cmd->add_option("-t,--threads", args->threads, "threads (0 = all cores)")->default_val(0);
  cmd->add_option("--numa", args->numa,
                  "NUMA placement: off; distribute (threads pinned round robin over nodes); split (each node "
                  "computes its slice of every expert from node-local memory). M3_FAKE_NUMA=N simulates N nodes")
      ->default_val("off")
      ->check(CLI::IsMember({"off", "distribute", "split"}));
  cmd->add_flag("--mlock-dense", args->mlock_dense,
                "lock attention, shared-expert, dense and lm_head weights in memory so that streaming routed "
                "experts from disk cannot evict them");
}

}  // namespace m3::cli
