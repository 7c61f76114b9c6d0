// Subcommands of the `m3` executable.
#pragma once

#include <CLI/CLI.hpp>

namespace m3::cli {

// Each registers a subcommand whose callback stores the process exit code in *rc.
void AddInspectCommand(CLI::App& app, int* rc);
void AddLogitsCommand(CLI::App& app, int* rc);
void AddTextCommands(CLI::App& app, int* rc);  // tokenize, template
void AddRunCommands(CLI::App& app, int* rc);   // run, chat
void AddPackCommand(CLI::App& app, int* rc);   // pack
void AddBenchCommand(CLI::App& app, int* rc);  // bench --kernels

}  // namespace m3::cli
