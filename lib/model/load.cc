// Model::Load (model.h): open the folder's weights, read its config, bind every tensor.
#include <filesystem>
#include <memory>
#include <string>
#include <utility>

#include "format/pack_file.h"
#include "format/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "model/weights.h"

namespace m3 {
namespace {

// Opens the weights of `dir`: the packed file when there is one (config.json beside it), else the
// HuggingFace checkpoint (which reads its own config). Sets exactly one of *pack and *checkpoint
// and returns the config JSON. A checkpoint that does not open next to a model.m3w.partial is
// reported as an unfinished `m3 pack`.
StatusOr<nlohmann::json> OpenWeights(const std::string& dir, std::unique_ptr<PackFile>* pack,
                                     std::unique_ptr<Checkpoint>* checkpoint) {
  const std::string pack_path = (std::filesystem::path(dir) / kPackFileName).string();
  if (std::filesystem::exists(pack_path)) {
    M3_ASSIGN_OR_RETURN(*pack, PackFile::Open(pack_path));
    return ReadJsonFile((std::filesystem::path(dir) / "config.json").string());
  }
  auto ck = Checkpoint::Open(dir);
  if (!ck.ok() && std::filesystem::exists(pack_path + ".partial"))
    return Status(ck.status().code(), ck.status().message() + " (" + kPackFileName +
                                          ".partial is there: `m3 pack` did not finish; run it again)");
  if (!ck.ok()) return ck.status();
  *checkpoint = std::move(ck).value();
  return (*checkpoint)->config_json();
}

// The parsed config, its errors prefixed with the folder; head and index widths above 1024 are
// refused.
StatusOr<ModelConfig> ReadConfig(const std::string& dir, const nlohmann::json& config_json) {
  auto cfg = ParseModelConfig(config_json);
  if (!cfg.ok()) return Status(cfg.status().code(), dir + "/" + cfg.status().message());
  if (cfg->head_dim > 1024 || (cfg->any_sparse() && cfg->sparse.index_dim > 1024))
    return Unsupported(dir, "/config.json: head_dim/index_dim above 1024 is not supported");
  return cfg;
}

}  // namespace

StatusOr<std::unique_ptr<Model>> Model::Load(const std::string& dir, const ModelLoadOptions& options) {
  const MoePart& part = options.expert_part;
  if (part.count < 1 || part.index < 0 || part.index >= part.count)
    return InvalidArgument("expert part ", part.index, " of ", part.count, ": expected 0 <= index < count");
  std::unique_ptr<Model> m(new Model());
  M3_ASSIGN_OR_RETURN(const nlohmann::json config_json, OpenWeights(dir, &m->pack_, &m->checkpoint_));
  M3_ASSIGN_OR_RETURN(m->config_, ReadConfig(dir, config_json));
  // Binding checks every tensor's name, shape and type against the config.
  if (m->pack_) {
    M3_ASSIGN_OR_RETURN(m->stats_, BindPackedWeights(m->config_, *m->pack_, &m->weights_));
  } else {
    M3_ASSIGN_OR_RETURN(m->stats_, BindWeights(m->config_, *m->checkpoint_, &m->weights_));
  }
  if (part.count > 1) {  // views of the mapping: the other slices' pages are never touched
    for (LayerWeights& L : m->weights_.layers)
      if (L.is_moe) L.moe = MoePartOf(L.moe, part);
    for (MtpWeights& mtp : m->weights_.mtp)
      if (mtp.layer.is_moe) mtp.layer.moe = MoePartOf(mtp.layer.moe, part);
  }
  m->rope_ = std::make_unique<Rope>(m->config_.rotary_dim, m->config_.rope_theta);
  return m;
}

}  // namespace m3
