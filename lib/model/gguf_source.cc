#include "model/gguf_source.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "model/weights.h"

namespace m3 {
namespace {

namespace fs = std::filesystem;

constexpr const char* kArch = "minimax-m3";
constexpr int64_t kMaxBlocks = 1024, kMaxExperts = 4096;

// The pre-tokenizer split of the MiniMax-M2/M3 tokenizer (llama.cpp's `minimax-m2`).
constexpr const char* kMiniMaxSplit =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// The GGUF name of an HF tensor, and the routed expert it is a slice of (-1: a whole tensor).
struct GgufName {
  std::string name;
  int expert = -1;
};

std::optional<GgufName> GgufNameOf(const std::string& hf) {
  static const std::map<std::string, std::string> kTop = {{"model.embed_tokens.weight", "token_embd.weight"},
                                                          {"lm_head.weight", "output.weight"},
                                                          {"model.norm.weight", "output_norm.weight"}};
  static const std::map<std::string, std::string> kLayer = {
      {"input_layernorm.weight", "attn_norm.weight"},
      {"post_attention_layernorm.weight", "ffn_norm.weight"},
      {"self_attn.q_proj.weight", "attn_q.weight"},
      {"self_attn.k_proj.weight", "attn_k.weight"},
      {"self_attn.v_proj.weight", "attn_v.weight"},
      {"self_attn.o_proj.weight", "attn_output.weight"},
      {"self_attn.q_norm.weight", "attn_q_norm.weight"},
      {"self_attn.k_norm.weight", "attn_k_norm.weight"},
      {"self_attn.index_q_proj.weight", "indexer.q_proj.weight"},
      {"self_attn.index_k_proj.weight", "indexer.k_proj.weight"},
      {"self_attn.index_q_norm.weight", "indexer.q_norm.weight"},
      {"self_attn.index_k_norm.weight", "indexer.k_norm.weight"},
      {"mlp.gate_proj.weight", "ffn_gate.weight"},
      {"mlp.up_proj.weight", "ffn_up.weight"},
      {"mlp.down_proj.weight", "ffn_down.weight"},
      {"block_sparse_moe.gate.weight", "ffn_gate_inp.weight"},
      {"block_sparse_moe.e_score_correction_bias", "exp_probs_b.bias"},
      {"block_sparse_moe.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"},
      {"block_sparse_moe.shared_experts.up_proj.weight", "ffn_up_shexp.weight"},
      {"block_sparse_moe.shared_experts.down_proj.weight", "ffn_down_shexp.weight"}};
  static const std::map<std::string, std::string> kExpert = {
      {"w1.weight", "ffn_gate_exps.weight"}, {"w3.weight", "ffn_up_exps.weight"}, {"w2.weight", "ffn_down_exps.weight"}};
  if (const auto it = kTop.find(hf); it != kTop.end()) return GgufName{it->second};
  const std::string prefix = "model.layers.";
  if (hf.rfind(prefix, 0) != 0) return std::nullopt;
  const size_t dot = hf.find('.', prefix.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string layer = hf.substr(prefix.size(), dot - prefix.size()), rest = hf.substr(dot + 1);
  const std::string blk = "blk." + layer + ".";
  if (const auto it = kLayer.find(rest); it != kLayer.end()) return GgufName{blk + it->second};
  const std::string experts = "block_sparse_moe.experts.";
  if (rest.rfind(experts, 0) != 0) return std::nullopt;
  const size_t edot = rest.find('.', experts.size());
  if (edot == std::string::npos) return std::nullopt;
  const auto it = kExpert.find(rest.substr(edot + 1));
  if (it == kExpert.end()) return std::nullopt;
  return GgufName{blk + it->second, std::stoi(rest.substr(experts.size(), edot - experts.size()))};
}

// Reads minimax-m3.<key>; errors name the file and the key.
class Hparams {
 public:
  explicit Hparams(const GgufMetadata& m) : m_(m) {}
  StatusOr<int64_t> Int(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    const std::string k = std::string(kArch) + "." + key;
    if (!m_.Has(k) && fallback) return *fallback;
    auto v = m_.GetInt(k);
    if (!v.ok()) return Status(v.status().code(), m_.path() + ": " + v.status().message());
    if (*v < 0 || *v > (int64_t{1} << 31)) return InvalidArgument(m_.path(), ": ", k, " = ", *v, " is out of range");
    return *v;
  }
  StatusOr<double> Float(const char* key, std::optional<double> fallback = std::nullopt) const {
    const std::string k = std::string(kArch) + "." + key;
    if (!m_.Has(k) && fallback) return *fallback;
    auto v = m_.GetFloat(k);
    if (!v.ok()) return Status(v.status().code(), m_.path() + ": " + v.status().message());
    if (!std::isfinite(*v)) return InvalidArgument(m_.path(), ": ", k, " is not finite");
    return *v;
  }
  StatusOr<bool> Bool(const char* key, bool fallback) const {
    const std::string k = std::string(kArch) + "." + key;
    if (!m_.Has(k)) return fallback;
    auto v = m_.GetBool(k);
    if (!v.ok()) return Status(v.status().code(), m_.path() + ": " + v.status().message());
    return *v;
  }

 private:
  const GgufMetadata& m_;
};

// The HF config.json of the model the GGUF holds.
StatusOr<nlohmann::json> ConfigFromGguf(const GgufShardSet& f) {
  const GgufMetadata& m = f.metadata();
  auto arch = m.GetString("general.architecture");
  if (!arch.ok()) return Status(arch.status().code(), m.path() + ": " + arch.status().message());
  if (*arch != kArch)
    return Unsupported(m.path(), ": a GGUF of architecture '", std::string(*arch), "'; m3 runs '", kArch, "' only");
  const Hparams h(m);
  const GgufTensorInfo* embed = f.Find("token_embd.weight");
  if (!embed) return InvalidArgument(m.path(), ": no tensor token_embd.weight");
  M3_ASSIGN_OR_RETURN(const int64_t layers, h.Int("block_count"));
  M3_ASSIGN_OR_RETURN(const int64_t hidden, h.Int("embedding_length"));
  M3_ASSIGN_OR_RETURN(const int64_t heads, h.Int("attention.head_count"));
  M3_ASSIGN_OR_RETURN(const int64_t kv_heads, h.Int("attention.head_count_kv"));
  if (heads <= 0 || kv_heads <= 0) return InvalidArgument(m.path(), ": attention head counts must be positive");
  M3_ASSIGN_OR_RETURN(const int64_t head_dim, h.Int("attention.key_length", hidden / heads));
  M3_ASSIGN_OR_RETURN(const int64_t value_dim, h.Int("attention.value_length", head_dim));
  if (value_dim != head_dim)
    return InvalidArgument(m.path(), ": ", kArch, ".attention.value_length ", value_dim, " differs from key_length ",
                           head_dim, " (MiniMax-M3 has one head width)");
  M3_ASSIGN_OR_RETURN(const int64_t dense_lead, h.Int("leading_dense_block_count", 0));
  if (dense_lead > layers) return InvalidArgument(m.path(), ": more leading dense blocks than blocks");
  M3_ASSIGN_OR_RETURN(const int64_t experts, h.Int("expert_count"));
  M3_ASSIGN_OR_RETURN(const int64_t top_k, h.Int("expert_used_count"));
  M3_ASSIGN_OR_RETURN(const int64_t expert_ff, h.Int("expert_feed_forward_length"));
  M3_ASSIGN_OR_RETURN(const int64_t shared, h.Int("expert_shared_count", 0));
  M3_ASSIGN_OR_RETURN(const int64_t dense_ff, h.Int("feed_forward_length", dense_lead > 0 ? std::nullopt : std::optional<int64_t>(0)));
  M3_ASSIGN_OR_RETURN(const double scale, h.Float("expert_weights_scale", 1.0));
  M3_ASSIGN_OR_RETURN(const bool norm_weights, h.Bool("expert_weights_norm", false));
  M3_ASSIGN_OR_RETURN(const int64_t gating, h.Int("expert_gating_func", 0));
  if (gating != 2 || !norm_weights)
    return InvalidArgument(m.path(), ": ", kArch, ".expert_gating_func must be 2 (sigmoid) with expert_weights_norm "
                           "true, as MiniMax-M3 routes (found ", gating, ", ", norm_weights ? "true" : "false", ")");
  M3_ASSIGN_OR_RETURN(const int64_t context, h.Int("context_length", 196608));
  M3_ASSIGN_OR_RETURN(const double eps, h.Float("attention.layer_norm_rms_epsilon"));
  M3_ASSIGN_OR_RETURN(const double theta, h.Float("rope.freq_base"));
  M3_ASSIGN_OR_RETURN(const int64_t rotary, h.Int("rope.dimension_count", head_dim));
  M3_ASSIGN_OR_RETURN(const int64_t index_heads, h.Int("attention.indexer.head_count"));
  M3_ASSIGN_OR_RETURN(const int64_t index_dim, h.Int("attention.indexer.key_length"));
  M3_ASSIGN_OR_RETURN(const int64_t topk_blocks, h.Int("attention.indexer.top_k"));
  M3_ASSIGN_OR_RETURN(const int64_t block, h.Int("attention.indexer.block_size"));
  M3_ASSIGN_OR_RETURN(const int64_t local_blocks, h.Int("attention.indexer.local_blocks"));
  const std::string vocab_key = std::string(kArch) + ".vocab_size";
  if (m.Has(vocab_key)) {
    M3_ASSIGN_OR_RETURN(const int64_t vocab, m.GetInt(vocab_key));
    if (vocab != embed->ne[1])
      return InvalidArgument(m.path(), ": ", vocab_key, " ", vocab, " but token_embd.weight has ", embed->ne[1], " rows");
  }
  const std::pair<const char*, std::pair<int64_t, int64_t>> widths[] = {
      {"embedding_length", {hidden, 1 << 18}},   {"attention.head_count", {heads, 4096}},
      {"attention.head_count_kv", {kv_heads, 4096}}, {"attention.key_length", {head_dim, 4096}},
      {"expert_feed_forward_length", {expert_ff, 1 << 20}}, {"feed_forward_length", {dense_ff, 1 << 20}},
      {"expert_shared_count", {shared, 64}},     {"rope.dimension_count", {rotary, head_dim}},
      {"attention.indexer.head_count", {index_heads, 4096}}, {"attention.indexer.key_length", {index_dim, 4096}},
      {"attention.indexer.top_k", {topk_blocks, 1 << 20}}, {"attention.indexer.block_size", {block, 1 << 16}},
      {"attention.indexer.local_blocks", {local_blocks, 1 << 20}}};
  for (const auto& [key, v] : widths)
    if (v.first > v.second) return InvalidArgument(m.path(), ": ", kArch, ".", key, " = ", v.first, " is above ", v.second);
  // Bounds before anything is sized by them: far beyond MiniMax-M3 (60 blocks, 128 experts), and
  // every MoE block must hold its stacked experts (so a file cannot ask for more work than it has
  // bytes for).
  if (layers < 1 || layers > kMaxBlocks || experts < 1 || experts > kMaxExperts || top_k < 1 || top_k > experts)
    return InvalidArgument(m.path(), ": ", layers, " blocks, ", experts, " experts, top ", top_k,
                           ": m3 reads 1-", kMaxBlocks, " blocks and 1-", kMaxExperts, " experts");
  for (int64_t l = dense_lead; l < layers; ++l) {
    const std::string name = "blk." + std::to_string(l) + ".ffn_gate_exps.weight";
    const GgufTensorInfo* t = f.Find(name);
    if (!t) return InvalidArgument(m.path(), ": no tensor '", name, "' (block ", l, " is a MoE block)");
    if (t->n_dims != 3 || t->ne[2] != experts)
      return InvalidArgument(m.path(), ": tensor '", name, "' is ", t->ShapeString(), ", not ", experts, " experts");
  }
  // llama.cpp's model: the leading dense blocks use dense attention, every later block is MoE
  // with sparse attention.
  std::vector<int> moe(static_cast<size_t>(layers));
  for (int64_t l = 0; l < layers; ++l) moe[static_cast<size_t>(l)] = l >= dense_lead;
  return nlohmann::json{
      {"architectures", {"MiniMaxM3SparseForCausalLM"}},
      {"model_type", "minimax_m3"},
      {"hidden_size", hidden},
      {"intermediate_size", expert_ff},
      {"dense_intermediate_size", dense_ff},
      {"shared_intermediate_size", expert_ff},
      {"n_shared_experts", shared},
      {"num_hidden_layers", layers},
      {"num_attention_heads", heads},
      {"num_key_value_heads", kv_heads},
      {"head_dim", head_dim},
      {"vocab_size", embed->ne[1]},
      {"max_position_embeddings", context},
      {"rms_norm_eps", eps},
      {"use_gemma_norm", true},
      {"attention_output_gate", false},
      {"rope_theta", theta},
      {"rotary_dim", rotary},
      {"partial_rotary_factor", static_cast<double>(rotary) / static_cast<double>(head_dim)},
      {"hidden_act", "swigluoai"},
      {"use_qk_norm", true},
      {"qk_norm_type", "per_head"},
      {"tie_word_embeddings", f.Find("output.weight") == nullptr},
      {"num_local_experts", experts},
      {"num_experts_per_tok", top_k},
      {"scoring_func", "sigmoid"},
      {"use_routing_bias", true},
      {"routed_scaling_factor", scale},
      {"moe_layer_freq", moe},
      {"swiglu_alpha", 1.702},
      {"swiglu_limit", 7.0},
      {"sparse_attention_config",
       {{"use_sparse_attention", true},
        {"sparse_attention_freq", moe},
        {"sparse_disable_index_value", moe},
        {"sparse_num_index_heads", index_heads},
        {"sparse_index_dim", index_dim},
        {"sparse_block_size", block},
        {"sparse_topk_blocks", topk_blocks},
        {"sparse_init_block", 0},
        {"sparse_local_block", local_blocks},
        {"sparse_score_type", "max"}}},
      {"num_mtp_modules", 0},
      {"m3_source", "gguf"}};
}

}  // namespace

bool IsGgufFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[4] = {};
  return in && fs::is_regular_file(path) && in.read(magic, 4) && std::memcmp(magic, "GGUF", 4) == 0;
}

StatusOr<std::unique_ptr<GgufSource>> GgufSource::Open(const std::string& path) {
  auto src = std::unique_ptr<GgufSource>(new GgufSource());
  M3_ASSIGN_OR_RETURN(src->file_, GgufShardSet::Open(path));
  const GgufShardSet& f = *src->file_;
  M3_ASSIGN_OR_RETURN(src->config_json_, ConfigFromGguf(f));
  auto cfg = ParseModelConfig(src->config_json_);
  if (!cfg.ok()) return Status(cfg.status().code(), path + ": the hyper-parameters: " + cfg.status().message());
  src->config_ = *cfg;

  // Every tensor the config implies, found under its GGUF name with the shape it implies.
  std::set<const GgufTensorInfo*> used;
  ModelWeights scratch;
  Status status = Status::Ok();
  ForEachTensor(src->config_, 0, &scratch, [&](TensorSlot& s) {
    if (!status.ok()) return;
    const auto name = GgufNameOf(s.name);
    if (!name) {
      status = Unsupported(path, ": m3 expects tensor '", s.name, "', which llama.cpp's minimax-m3 does not have");
      return;
    }
    if (s.name == "lm_head.weight" && src->config_.tie_word_embeddings) return;
    const GgufTensorInfo* t = f.Find(name->name);
    if (!t) {
      status = InvalidArgument(path, ": no tensor '", name->name, "' (", s.name, ")");
      return;
    }
    Tensor rec;
    rec.gguf = t;
    rec.norm = s.is_norm;
    const bool vector = s.shape.size() == 1;
    rec.rows = vector ? 1 : static_cast<uint64_t>(s.shape[0]);
    rec.cols = static_cast<uint64_t>(vector ? s.shape[0] : s.shape[1]);
    const int64_t experts = src->config_.num_experts;
    const bool stacked = name->expert >= 0;
    const bool shape_ok = t->ne[0] == static_cast<int64_t>(rec.cols) &&
                          (vector ? t->n_dims == 1
                                  : t->ne[1] == static_cast<int64_t>(rec.rows) &&
                                        (stacked ? t->n_dims == 3 && t->ne[2] == experts : t->n_dims == 2));
    if (!shape_ok) {
      status = InvalidArgument(path, ": tensor '", name->name, "' is ", t->ShapeString(), " but the hyper-parameters imply [",
                               rec.cols, vector ? "" : ", " + std::to_string(rec.rows),
                               stacked ? ", " + std::to_string(experts) : "", "] (", s.name, ")");
      return;
    }
    if (!CanDequantizeGgml(t->type)) {
      status = Unsupported(path, ": tensor '", name->name, "' is ", GgmlTypeName(t->type),
                           ", which m3 cannot convert (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K-Q6_K)");
      return;
    }
    if (stacked) rec.first_row = static_cast<uint64_t>(name->expert) * rec.rows;
    used.insert(t);
    src->tensors_[s.name] = rec;
  });
  M3_RETURN_IF_ERROR(status);
  for (const GgufTensorInfo* t : f.tensors())
    if (!used.count(t))
      return InvalidArgument(path, ": tensor '", t->name, "' is not part of ", kArch,
                             " as m3 reads it (a newer converter, or another model?)");
  return src;
}

const GgufSource::Tensor* GgufSource::Find(const std::string& hf_name) const {
  const auto it = tensors_.find(hf_name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Status GgufSource::DecodeRows(const Tensor& t, uint64_t r0, uint64_t n, float* out) const {
  M3_RETURN_IF_ERROR(DequantizeGgufRows(*t.gguf, t.first_row + r0, n, out));
  if (t.norm)  // llama.cpp stored 1 + w: w back (exact for stored values in [0.5, 2], as norms are)
    for (uint64_t i = 0; i < n * t.cols; ++i) out[i] -= 1.0f;
  return Status::Ok();
}

std::map<std::string, size_t> GgufSource::type_counts() const {
  std::map<std::string, size_t> counts;
  std::set<const GgufTensorInfo*> seen;
  for (const auto& [name, t] : tensors_)
    if (seen.insert(t.gguf).second) ++counts[GgmlTypeName(t.gguf->type)];
  return counts;
}

Status GgufSource::WriteTokenizerFiles(const std::string& dir) const {
  const GgufMetadata& m = file_->metadata();
  if (!m.Has("tokenizer.ggml.model")) return Status::Ok();  // a model without one runs on token ids
  auto model = m.GetString("tokenizer.ggml.model");
  if (!model.ok()) return Status(model.status().code(), m.path() + ": " + model.status().message());
  if (*model == "none") return Status::Ok();
  if (*model != "gpt2")
    return Unsupported(m.path(), ": tokenizer.ggml.model is '", std::string(*model),
                       "'; MiniMax-M3's tokenizer is byte-level BPE ('gpt2')");
  if (m.Has("tokenizer.ggml.pre")) {
    M3_ASSIGN_OR_RETURN(const std::string_view pre, m.GetString("tokenizer.ggml.pre"));
    if (pre != "minimax-m2" && pre != "minimax-m3")
      return Unsupported(m.path(), ": tokenizer.ggml.pre is '", std::string(pre),
                         "', not the MiniMax pre-tokenizer ('minimax-m2')");
  }
  M3_ASSIGN_OR_RETURN(const auto tokens, m.GetStringArray("tokenizer.ggml.tokens"));
  M3_ASSIGN_OR_RETURN(const auto merges, m.GetStringArray("tokenizer.ggml.merges"));
  std::vector<int64_t> types(tokens.size(), 1);
  if (m.Has("tokenizer.ggml.token_type")) {
    M3_ASSIGN_OR_RETURN(types, m.GetIntArray("tokenizer.ggml.token_type"));
    if (types.size() != tokens.size())
      return InvalidArgument(m.path(), ": tokenizer.ggml.token_type has ", types.size(), " entries for ", tokens.size(),
                             " tokens");
  }
  if (tokens.size() > static_cast<size_t>(config_.vocab_size))
    return InvalidArgument(m.path(), ": ", tokens.size(), " tokens but the embedding has ", config_.vocab_size, " rows");
  // Types: 1 normal, 3 control (special), 4 user-defined (added, not special), 5 unused (the
  // padding up to the embedding's rows: left out).
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  std::set<std::string> seen;
  for (size_t id = 0; id < tokens.size(); ++id) {
    const std::string tok(tokens[id]);
    if (types[id] == 5) continue;
    if (!seen.insert(tok).second) return InvalidArgument(m.path(), ": token '", tok, "' appears twice in the vocabulary");
    if (types[id] == 3 || types[id] == 4)
      added.push_back({{"id", id}, {"content", tok}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", types[id] == 3}});
    else
      vocab[tok] = id;
  }
  nlohmann::json merge_list = nlohmann::json::array();
  for (const std::string_view mg : merges) merge_list.push_back(std::string(mg));
  const nlohmann::json tokenizer = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"}, {"pattern", {{"Regex", kMiniMaxSplit}}}, {"behavior", "Removed"}, {"invert", true}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", ""},
        {"end_of_word_suffix", ""},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"vocab", vocab},
        {"merges", merge_list}}}};
  auto write = [&](const std::string& name, const std::string& text) -> Status {
    const fs::path p = fs::path(dir) / name;
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << text;
    out.flush();
    if (!out) return IoError(p.string(), ": cannot write");
    return Status::Ok();
  };
  M3_RETURN_IF_ERROR(write("tokenizer.json", tokenizer.dump()));
  if (m.Has("tokenizer.chat_template")) {
    M3_ASSIGN_OR_RETURN(const std::string_view tmpl, m.GetString("tokenizer.chat_template"));
    M3_RETURN_IF_ERROR(write("chat_template.jinja", std::string(tmpl)));
  }
  if (m.Has("tokenizer.ggml.eos_token_id")) {
    M3_ASSIGN_OR_RETURN(const int64_t eos, m.GetInt("tokenizer.ggml.eos_token_id"));
    if (eos < 0 || eos >= static_cast<int64_t>(tokens.size()))
      return InvalidArgument(m.path(), ": tokenizer.ggml.eos_token_id ", eos, " is not a token");
    M3_RETURN_IF_ERROR(write("generation_config.json", nlohmann::json{{"eos_token_id", eos}}.dump()));
  }
  return Status::Ok();
}

}  // namespace m3
