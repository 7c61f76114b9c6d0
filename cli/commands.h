// Subcommands of the `m3` executable.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "base/status.h"
#include "runtime/engine.h"

namespace m3::cli {

// The engine options of every command that runs a model: -t, --numa, --mlock-dense.
struct EngineArgs {
  int threads = 0;
  std::string numa = "off";
  bool mlock_dense = false;
  StatusOr<EngineOptions> Options() const;
};
void AddEngineOptions(CLI::App* cmd, EngineArgs* args);

// Each registers a subcommand whose callback stores the process exit code in *rc.
void AddInspectCommand(CLI::App& app, int* rc);
void AddLogitsCommand(CLI::App& app, int* rc);
void AddTextCommands(CLI::App& app, int* rc);  // tokenize, template
void AddRunCommands(CLI::App& app, int* rc);   // run, chat
void AddPackCommand(CLI::App& app, int* rc);   // pack
void AddBenchCommand(CLI::App& app, int* rc);  // bench (end to end), bench --kernels

}  // namespace m3::cli
