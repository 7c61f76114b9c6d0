// m3 inspect -m DIR [--verify]: config summary, layer kinds, tensors, bytes by dtype (or by packed
// format, with the pack type), parameter counts, SIMD target; --verify hashes a packed file, or
// checks that every value of a checkpoint is finite.
#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "cli/commands.h"
#include "ops/context.h"
#include "model/dense_part.h"
#include "model/model.h"
#include "offload/gpu.h"

namespace m3::cli {
namespace {

std::string Human(double n, const char* unit) {
  const char* prefixes[] = {"", "K", "M", "G", "T"};
  int i = 0;
  while (n >= 1000 && i < 4) n /= 1000, ++i;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f %s%s", n, prefixes[i], unit);
  return buf;
}

int RunInspect(const std::string& dir, bool verify) {
  auto model = Model::Load(dir);
  if (!model.ok()) {
    std::fprintf(stderr, "m3 inspect: %s\n", model.status().ToString().c_str());
    return 1;
  }
  const Model& m = **model;
  const ModelConfig& c = m.config();
  std::printf("model            %s (%s layout)\n", dir.c_str(), c.vl_layout ? "VL, text_config" : "text");
  std::printf("hidden           %d, vocab %d, max positions %lld\n", c.hidden_size, c.vocab_size,
              static_cast<long long>(c.max_position_embeddings));
  std::printf("attention        %d q heads, %d kv heads, head_dim %d, rotary %d, theta %g\n", c.num_heads,
              c.num_kv_heads, c.head_dim, c.rotary_dim, c.rope_theta);
  if (c.any_sparse())
    std::printf("sparse attention %d index heads x %d, block %d, top-%d, init %d, local %d\n", c.sparse.num_index_heads,
                c.sparse.index_dim, c.sparse.block_size, c.sparse.topk_blocks, c.sparse.init_blocks,
                c.sparse.local_blocks);
  if (c.any_moe())
    std::printf("moe              %d experts x %d, top-%d, shared %d, routed scale %g\n", c.num_experts,
                c.moe_intermediate_size, c.experts_per_token, c.shared_intermediate_size, c.routed_scaling_factor);
  if (c.any_dense_mlp()) std::printf("dense mlp        %d\n", c.dense_intermediate_size);
  std::printf("layers           %d:", c.num_layers);
  for (int l = 0; l < c.num_layers; ++l)
    std::printf(" %s%s", c.sparse_layer[l] ? "S" : "D", c.moe_layer[l] ? "+moe" : "+mlp");
  std::printf("   (S sparse / D dense attention)\n");

  std::map<std::string, std::pair<size_t, size_t>> by_dtype;  // dtype or packed format -> (tensors, bytes)
  size_t tensors = 0;
  if (const PackFile* pack = m.pack()) {
    for (const auto& t : pack->tensors()) {
      auto& e = by_dtype[PackedFormatName(t.format)];
      ++e.first;
      e.second += t.data.bytes + t.scales.bytes;
      ++tensors;
    }
    const nlohmann::json& d = pack->directory();
    std::string version = "?", source = "?";
    if (d.contains("m3_version") && d["m3_version"].is_string()) version = d["m3_version"].get<std::string>();
    if (d.contains("source") && d["source"].is_object() && d["source"].value("dir", nlohmann::json()).is_string())
      source = d["source"]["dir"].get<std::string>();
    std::printf("packed           %s by m3 %s from %s\n", pack->pack_type().c_str(), version.c_str(), source.c_str());
    std::printf("tensors          %zu in %s (%s), %zu expert ranges\n", tensors, kPackFileName,
                Human(static_cast<double>(pack->file().size()), "B").c_str(), pack->expert_ranges().size());
    if (const std::string full = ReleasedFootprint(pack->pack_type()); !full.empty())
      std::printf("full model       %s\n", full.c_str());
  } else {
    for (const auto& [name, t] : m.checkpoint()->text_tensors()) {
      auto& e = by_dtype[DTypeName(t->dtype)];
      ++e.first;
      e.second += t->nbytes;
      ++tensors;
    }
    std::printf("tensors          %zu text tensors in %zu file(s), %zu non-text skipped\n", tensors,
                m.checkpoint()->files().size(), m.checkpoint()->skipped_tensor_count());
  }
  for (const auto& [dtype, e] : by_dtype)
    std::printf("  %-8s       %6zu tensors  %s\n", dtype.c_str(), e.first, Human(static_cast<double>(e.second), "B").c_str());
  const WeightStats& s = m.stats();
  std::printf("parameters       total %lld (%s), active per token %lld (%s)\n", static_cast<long long>(s.total_params),
              Human(static_cast<double>(s.total_params), "").c_str(), static_cast<long long>(s.active_params),
              Human(static_cast<double>(s.active_params), "").c_str());
  // Every weight a token reads in full (all but the routed experts and the embedding table): what
  // --mlock-dense locks, and what an accelerator holding the dense layers would hold.
  const DensePart dense = MeasureDensePart(c, m.weights());
  std::printf("dense part       %lld params (%s), %s as stored:", static_cast<long long>(dense.params()),
              Human(static_cast<double>(dense.params()), "").c_str(), Human(static_cast<double>(dense.bytes()), "B").c_str());
  for (const DensePartGroup& g : dense.groups)
    std::printf("%s %s %s", &g == &dense.groups.front() ? "" : ",", g.name.c_str(),
                Human(static_cast<double>(g.bytes), "B").c_str());
  std::printf("\n");
  // The GPU an offload of the dense part would use (issue 34), or why there is none.
  const GpuFootprint per_8k = EstimateGpuFootprint(c, dense, CacheOptions{}, 8192);
  std::printf("gpu footprint    the dense part %s + f32 caches %s per 8K tokens of context\n",
              Human(static_cast<double>(per_8k.weight_bytes), "B").c_str(),
              Human(static_cast<double>(per_8k.cache_bytes), "B").c_str());
  if (const StatusOr<GpuInfo> gpu = QueryGpu(0); gpu.ok()) {
    std::printf("gpu              %s: %s (compute %d.%d), %s free of %s; with the dense part, f32 caches of up to %zu "
                "tokens fit\n",
                GpuBackendName(), gpu->name.c_str(), gpu->compute_major, gpu->compute_minor,
                Human(static_cast<double>(gpu->free_bytes), "B").c_str(),
                Human(static_cast<double>(gpu->total_bytes), "B").c_str(),
                LongestGpuContext(c, dense, CacheOptions{}, gpu->free_bytes));
  } else {
    std::printf("gpu              none: %s\n", gpu.status().message().c_str());
  }
  std::printf("mtp modules      %d bound (config declares %d)\n", s.mtp_depths, c.num_mtp_modules);
  std::printf("kernels          %s\n", Kernels().Describe().c_str());
  if (!verify) return 0;
  const auto start = std::chrono::steady_clock::now();
  const ThreadConfig tc{DefaultThreadCount()};
  const Status st = m.pack() ? m.pack()->Verify(tc) : VerifyFiniteValues(*m.checkpoint(), tc);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!st.ok()) {
    std::printf("verify           FAILED\n");
    std::fprintf(stderr, "m3 inspect: %s\n", st.ToString().c_str());
    return 1;
  }
  if (m.pack()) {
    std::printf("verify           ok: %zu tensor hashes match (%s in %.2f s)\n", m.pack()->tensors().size(),
                Human(static_cast<double>(m.pack()->file().size()), "B").c_str(), secs);
  } else {
    uint64_t bytes = 0;
    for (const auto& [name, t] : m.checkpoint()->text_tensors()) bytes += t->nbytes;
    std::printf("verify           ok: every value of %zu tensors is finite (%s in %.2f s)\n",
                m.checkpoint()->text_tensors().size(), Human(static_cast<double>(bytes), "B").c_str(), secs);
  }
  return 0;
}

}  // namespace

void AddInspectCommand(CLI::App& app, int* rc) {
  auto* cmd = app.add_subcommand("inspect", "Summarize a model folder: config, layers, tensors, parameters");
  auto dir = std::make_shared<std::string>();
  auto verify = std::make_shared<bool>(false);
  cmd->add_option("-m,--model", *dir, "HuggingFace checkpoint folder or packed folder (m3 pack)")->required();
  cmd->add_flag("--verify", *verify,
                "read every tensor: a packed folder's hashes must match its directory, a checkpoint's "
                "values must be finite");
  cmd->callback([dir, verify, rc] { *rc = RunInspect(*dir, *verify); });
}

}  // namespace m3::cli
