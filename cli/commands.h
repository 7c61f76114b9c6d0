// Subcommands of the `m3` executable.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

#include "base/status.h"
#include "ops/sampling.h"
#include "runtime/engine.h"
#include "runtime/generate.h"

namespace m3::cli {

// The engine and session options of every command that runs a model: -t, --numa, --mlock-dense,
// --kernels, --kv-cache, --index-cache, --prefill-chunk, --gpu, --gpu-device, --gpu-id, --dist.
struct EngineArgs {
  int threads = 0;
  std::string numa = "off";
  bool mlock_dense = false;
  std::string verify_weights = "first-load";
  std::string kernels = "auto";
  std::string kv_cache = "f32", index_cache = "f32";
  size_t prefill_chunk = 0;
  std::string gpu = "none", gpu_device = "cuda";
  int gpu_id = 0;
  std::string dist = "auto";
  StatusOr<EngineOptions> Options() const;
  // Sets the cache types and the prefill chunk of `session` (InvalidArgument for a bad name).
  Status Configure(SessionOptions* session) const;
  // Options(), Configure(session), then opens the engine on `model_dir`.
  StatusOr<std::unique_ptr<Engine>> Open(const std::string& model_dir, SessionOptions* session) const;
};
void AddEngineOptions(CLI::App* cmd, EngineArgs* args);
// --gpu, --gpu-device, --gpu-id and --dist alone (m3 bench, which has its own engine options).
void AddGpuOptions(CLI::App* cmd, EngineArgs* args);
// --temp, --top-k, --top-p, --min-p, --repeat-penalty, --presence-penalty, --frequency-penalty,
// --seed.
void AddSamplingOptions(CLI::App* cmd, SamplingParams* p);
// --lookup K: speculative decoding by prompt lookup (LookupOptions::max_draft).
void AddLookupOption(CLI::App* cmd, LookupOptions* o);
// --literal-content of serve and batch (RequestDefaults::literal_content).
void AddLiteralContentOption(CLI::App* cmd, bool* literal_content);
// "the released MiniMax-M3 (60 layers) at TYPE: X GB" for m3 pack and m3 inspect; "" for an
// unknown type or without the benchmarks (their generator holds the released shapes).
std::string ReleasedFootprint(const std::string& pack_type);
// " | lookup: A of D guesses accepted" when lookup guessed any, else "".
std::string LookupSummary(const GenerateStats& st);
// Says on stderr when -t asks for more threads than the CPUs this process may run on (the
// library caps them: ResolveThreadCount).
void NoteThreadCap(int requested);
// The simulated NUMA nodes of M3_FAKE_NUMA=N (tests: --numa on N logical nodes of this machine's
// CPUs), 0 when unset; an error naming the variable when malformed.
StatusOr<int> SimulatedNumaNodes();

// The MPI job this program joined (main.cc, before any command runs), or null: every engine a
// command opens is given it (EngineArgs::Options puts it in EngineOptions::group).
cluster::Group* JobGroup();
void SetJobGroup(cluster::Group* group);
// What this program does when the watchdog reports a lost rank (docs/DIST.md): `tell` says so
// (with ": stopping every rank" added to the status's message), then after a grace of 2 s (m3
// serve answers 503 meanwhile) every rank stops: MPI_Abort, exit code 1.
void StopJobOnLostRank(cluster::Group& group, std::function<void(const Status&)> tell);

// Token ids given as "1,2,3" (also space- or newline-separated, brackets ignored) or @FILE
// holding such a list; `option` names the flag in errors.
StatusOr<std::vector<int32_t>> ParseIdList(const std::string& option, const std::string& spec);

// The tokens of a text file (`file`, - for stdin; tokenized as is with the tokenizer of
// `tokenizer_dir`) or of an id list (`ids`, as ParseIdList): exactly one of them given.
StatusOr<std::vector<int32_t>> ReadTextTokens(const std::string& file, const std::string& ids,
                                              const std::string& tokenizer_dir);

// Each registers a subcommand whose callback stores the process exit code in *rc.
void AddInspectCommand(CLI::App& app, int* rc);
void AddLogitsCommand(CLI::App& app, int* rc);
void AddTextCommands(CLI::App& app, int* rc);  // tokenize, template
void AddRunCommands(CLI::App& app, int* rc);   // run, chat
void AddPackCommand(CLI::App& app, int* rc);   // pack
void AddBenchCommand(CLI::App& app, int* rc);  // bench (end to end), bench --kernels
void AddServeCommand(CLI::App& app, int* rc);  // serve (OpenAI-compatible HTTP)
void AddBatchCommand(CLI::App& app, int* rc);  // batch (offline, a file of requests)
void AddPerplexityCommand(CLI::App& app, int* rc);  // perplexity (scoring a text, KL from a base)
void AddImatrixCommand(CLI::App& app, int* rc);     // imatrix (importance of the matrices' inputs)

}  // namespace m3::cli
