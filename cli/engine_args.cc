#include "cli/commands.h"

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "cluster/group.h"
#include "platform/numa.h"
#include "platform/parallel.h"

namespace m3::cli {
namespace {

cluster::Group* job_group = nullptr;  // main's, while a command runs

}  // namespace

cluster::Group* JobGroup() { return job_group; }
void SetJobGroup(cluster::Group* group) { job_group = group; }

void StopJobOnLostRank(cluster::Group& group, std::function<void(const Status&)> tell) {
  group.OnFailure([&group, tell = std::move(tell)](const Status& lost) {
    tell(Status(lost.code(), lost.message() + ": stopping every rank"));
    std::this_thread::sleep_for(std::chrono::seconds(2));
    std::fprintf(stderr, "m3: %s: %s: stopping every rank\n", group.Describe(group.rank()).c_str(),
                 lost.message().c_str());
    std::fflush(stderr);
    group.AbortJob(1);
    std::_Exit(1);  // MPI could not end the job: this rank at least ends
  });
}

StatusOr<int> SimulatedNumaNodes() {
  const char* value = std::getenv("M3_FAKE_NUMA");
  StatusOr<int> nodes = ParseSimulatedNodes(value ? value : "");
  if (!nodes.ok()) return InvalidArgument("M3_FAKE_NUMA=", nodes.status().message());
  return nodes;
}

StatusOr<EngineOptions> EngineArgs::Options() const {
  if (threads < 0) return InvalidArgument("-t must be >= 0 (0 = all cores), got ", threads);
  NoteThreadCap(threads);
  EngineOptions o;
  o.threads = threads;
  M3_ASSIGN_OR_RETURN(o.numa, ParseNumaMode(numa));
  o.mlock_dense = mlock_dense;
  o.verify_weights = verify_weights == "first-load";
  o.kernels = kernels;
  o.gpu = gpu;
  o.gpu_device = gpu_device;
  o.gpu_ordinal = gpu_id;
  o.dist = dist;
  o.group = JobGroup();
  if (o.numa != NumaMode::kOff) {  // a malformed M3_FAKE_NUMA matters only then
    M3_ASSIGN_OR_RETURN(o.simulated_numa_nodes, SimulatedNumaNodes());
  }
  return o;
}

namespace {
StatusOr<CacheType> ParseCacheTypeArg(const char* option, const std::string& name) {
  CacheType t;
  if (!simd::ParseCacheType(name.c_str(), &t)) return InvalidArgument(option, " must be f32, bf16 or int8, got '", name, "'");
  return t;
}
}  // namespace

Status EngineArgs::Configure(SessionOptions* session) const {
  M3_ASSIGN_OR_RETURN(session->cache.kv, ParseCacheTypeArg("--kv-cache", kv_cache));
  M3_ASSIGN_OR_RETURN(session->cache.index_keys, ParseCacheTypeArg("--index-cache", index_cache));
  if (gpu == "dense" && (session->cache.kv != CacheType::kF32 || session->cache.index_keys != CacheType::kF32))
    return InvalidArgument("--gpu dense keeps the caches in GPU memory in f32: --kv-cache and --index-cache "
                           "choose the CPU's caches, so leave them at f32");
  session->prefill_chunk = prefill_chunk;
  return Status::Ok();
}

StatusOr<std::unique_ptr<Engine>> EngineArgs::Open(const std::string& model_dir, SessionOptions* session) const {
  M3_ASSIGN_OR_RETURN(const EngineOptions options, Options());
  M3_RETURN_IF_ERROR(Configure(session));
  return Engine::Open(model_dir, options);
}

StatusOr<std::vector<int32_t>> ParseIdList(const std::string& option, const std::string& spec) {
  std::string text = spec;
  if (!spec.empty() && spec[0] == '@') {
    std::ifstream in(spec.substr(1));
    if (!in) return NotFound(spec.substr(1), ": cannot read the id file");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  for (char& ch : text)
    if (ch == '[' || ch == ']' || ch == '\n' || ch == '\r' || ch == '\t' || ch == ' ') ch = ',';
  std::vector<int32_t> ids;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(item, &used);
    } catch (...) {
      used = 0;
    }
    if (used != item.size() || v < 0 || v > INT32_MAX) return InvalidArgument(option, ": '", item, "' is not a token id");
    ids.push_back(static_cast<int32_t>(v));
  }
  if (ids.empty()) return InvalidArgument(option, ": no token ids given");
  return ids;
}

void NoteThreadCap(int requested) {
  const int used = ResolveThreadCount(requested);
  if (requested > used)
    std::fprintf(stderr, "m3: -t %d is more than the %d CPUs this process may run on; using %d threads\n", requested,
                 used, used);
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
  cmd->add_option("--verify-weights", args->verify_weights,
                  "first-load: on a packed model's first load on this machine, check its tensor hashes in the "
                  "background as the engine's reads bring them in (idle priority; a damaged tensor then fails "
                  "every pass by name; a stamp in ~/.cache/m3/verified skips later loads); off: never")
      ->default_val("first-load")
      ->check(CLI::IsMember({"first-load", "off"}));
  cmd->add_option("--kernels", args->kernels,
                  "matmul kernels: auto (this CPU's best), or one implementation to compare (ref, avx2, "
                  "avx512-vnni, ...; a wrong name lists those this CPU runs); m3 inspect names them")
      ->default_val("auto");
  cmd->add_option("--kv-cache", args->kv_cache,
                  "storage of the attention K/V cache: f32 (exact), bf16 (half the memory) or int8 (a quarter, "
                  "one scale per head and position)")
      ->default_val("f32");
  cmd->add_option("--index-cache", args->index_cache,
                  "storage of the sparse-attention indexer keys: f32 (exact), bf16 or int8")
      ->default_val("f32");
  cmd->add_option("--prefill-chunk", args->prefill_chunk,
                  "most prompt tokens per forward pass (0: 2048, and for longer prompts a chunk sized for the model and "
                  "this machine, see docs/KERNELS.md; scoring passes at most 512): bounds the activation memory of "
                  "long prompts")
      ->default_val(0);
  AddGpuOptions(cmd, args);
}

void AddGpuOptions(CLI::App* cmd, EngineArgs* args) {
  cmd->add_option("--gpu", args->gpu,
                  "dense: attention, indexer, shared experts, dense MLPs and lm_head on a GPU, the routed experts "
                  "on the CPU (a build with CUDA); none: all on the CPU")
      ->default_val("none")
      ->check(CLI::IsMember({"none", "dense"}));
  cmd->add_option("--gpu-device", args->gpu_device,
                  "--gpu dense runs on: cuda (the GPU), or host: the same offloaded pass on the CPU, through the "
                  "reference implementation of the GPU operations (tests; slow)")
      ->default_val("cuda")
      ->check(CLI::IsMember({"cuda", "host"}));
  cmd->add_option("--gpu-id", args->gpu_id, "which CUDA GPU --gpu dense uses (0 = the first)")->default_val(0);
  cmd->add_option("--dist", args->dist,
                  "expert parallelism over MPI (docs/DIST.md): auto (when started by mpirun with 2+ ranks), mpi "
                  "(require it) or none; each rank holds a slice of every expert, rank 0 runs the rest")
      ->default_val("auto")
      ->check(CLI::IsMember({"auto", "mpi", "none"}));
}

void AddSamplingOptions(CLI::App* cmd, SamplingParams* p) {
  // Defaults: the recommended settings of docs/MODEL.md §6.5.
  cmd->add_option("--temp", p->temperature, "temperature (0 = greedy)")->default_val(1.0);
  cmd->add_option("--top-k", p->top_k, "top-k (0 = off)")->default_val(40);
  cmd->add_option("--top-p", p->top_p, "top-p (1 = off)")->default_val(0.95);
  cmd->add_option("--min-p", p->min_p, "min-p (0 = off)")->default_val(0.0);
  cmd->add_option("--repeat-penalty", p->repetition_penalty, "repetition penalty (1 = off)")->default_val(1.0);
  cmd->add_option("--presence-penalty", p->presence_penalty,
                  "presence penalty: subtracted once from tokens seen in the prompt or the output (0 = off)")
      ->default_val(0.0);
  cmd->add_option("--frequency-penalty", p->frequency_penalty,
                  "frequency penalty: subtracted per occurrence in the output so far, as OpenAI's (-2..2, 0 = off)")
      ->default_val(0.0);
  cmd->add_option("--seed", p->seed, "random seed")->default_val(0);
}

void AddLookupOption(CLI::App* cmd, LookupOptions* o) {
  cmd->add_option("--lookup", o->max_draft,
                  "speculative decoding by prompt lookup: guess up to K tokens per step from an earlier occurrence "
                  "of the latest 2-4 tokens, verified in the same forward pass (same greedy output; 0..32, 0 = off)")
      ->default_val(0);
}

void AddLiteralContentOption(CLI::App* cmd, bool* literal_content) {
  cmd->add_flag("--literal-content", *literal_content,
                "encode the text of chat messages (all but the assistant's) as plain text: a user who types "
                "\"<mm:think>\" or \"[e~[\" gets those letters, not the control tokens (the default, as HF's "
                "chat template, gives the tokens)");
}

std::string LookupSummary(const GenerateStats& st) {
  if (st.drafted_tokens == 0) return "";
  return Str(" | lookup: ", st.accepted_tokens, " of ", st.drafted_tokens, " guesses accepted");
}

}  // namespace m3::cli
