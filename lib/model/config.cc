#include "model/config.h"

#include <algorithm>
#include <cmath>

namespace m3 {
namespace {

using nlohmann::json;

// Typed access to one JSON object; every error names the full key path.
class KeyReader {
 public:
  KeyReader(const json& obj, std::string prefix) : obj_(obj), prefix_(std::move(prefix)) {}

  bool Has(const std::string& key) const { return obj_.contains(key) && !obj_[key].is_null(); }
  std::string Path(const std::string& key) const { return prefix_ + key; }
  const json& Raw(const std::string& key) const { return obj_[key]; }

  Status Int(const std::string& key, int64_t* out, bool required, int64_t min_value = 0) const {
    if (!Has(key)) return required ? NotFound("config.json: required key '", Path(key), "' is missing") : Status::Ok();
    const json& v = obj_[key];
    if (v.is_number_integer() || v.is_number_unsigned()) {
      *out = v.get<int64_t>();
    } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() && std::abs(v.get<double>()) < 9e15) {
      *out = static_cast<int64_t>(v.get<double>());
    } else {
      return InvalidArgument("config.json: key '", Path(key), "' must be an integer, got ", v.dump());
    }
    if (*out < min_value) return InvalidArgument("config.json: key '", Path(key), "' must be >= ", min_value, ", got ", *out);
    return Status::Ok();
  }
  Status Int(const std::string& key, int* out, bool required, int64_t min_value = 0) const {
    int64_t v = *out;
    M3_RETURN_IF_ERROR(Int(key, &v, required, min_value));
    if (v > INT32_MAX) return InvalidArgument("config.json: key '", Path(key), "' is too large: ", v);
    *out = static_cast<int>(v);
    return Status::Ok();
  }
  Status Number(const std::string& key, double* out, bool required) const {
    if (!Has(key)) return required ? NotFound("config.json: required key '", Path(key), "' is missing") : Status::Ok();
    const json& v = obj_[key];
    if (!v.is_number()) return InvalidArgument("config.json: key '", Path(key), "' must be a number, got ", v.dump());
    *out = v.get<double>();
    if (!std::isfinite(*out)) return InvalidArgument("config.json: key '", Path(key), "' must be finite");
    return Status::Ok();
  }
  Status Float(const std::string& key, float* out, bool required) const {
    double d = *out;
    M3_RETURN_IF_ERROR(Number(key, &d, required));
    *out = static_cast<float>(d);
    return Status::Ok();
  }
  Status Bool(const std::string& key, bool* out, bool required) const {
    if (!Has(key)) return required ? NotFound("config.json: required key '", Path(key), "' is missing") : Status::Ok();
    const json& v = obj_[key];
    if (!v.is_boolean()) return InvalidArgument("config.json: key '", Path(key), "' must be true or false, got ", v.dump());
    *out = v.get<bool>();
    return Status::Ok();
  }
  Status String(const std::string& key, std::string* out, bool required) const {
    if (!Has(key)) return required ? NotFound("config.json: required key '", Path(key), "' is missing") : Status::Ok();
    const json& v = obj_[key];
    if (!v.is_string()) return InvalidArgument("config.json: key '", Path(key), "' must be a string, got ", v.dump());
    *out = v.get<std::string>();
    return Status::Ok();
  }
  // A per-layer flag list: 0/1 integers or booleans, exactly n entries.
  Status Flags(const std::string& key, size_t n, std::vector<bool>* out) const {
    const json& v = obj_[key];
    if (!v.is_array()) return InvalidArgument("config.json: key '", Path(key), "' must be a list, got ", v.dump());
    if (v.size() != n)
      return InvalidArgument("config.json: key '", Path(key), "' has ", v.size(), " entries but num_hidden_layers is ", n);
    out->clear();
    for (size_t i = 0; i < v.size(); ++i) {
      const json& e = v[i];
      if (e.is_boolean()) out->push_back(e.get<bool>());
      else if ((e.is_number_integer() || e.is_number_unsigned()) && (e.get<int64_t>() == 0 || e.get<int64_t>() == 1))
        out->push_back(e.get<int64_t>() == 1);
      else
        return InvalidArgument("config.json: key '", Path(key), "[", i, "]' must be 0 or 1, got ", e.dump());
    }
    return Status::Ok();
  }
  // A per-layer list of type names: `true_name` -> true, `false_name` -> false.
  Status TypeNames(const std::string& key, size_t n, const char* true_name, const char* false_name,
                   std::vector<bool>* out) const {
    const json& v = obj_[key];
    if (!v.is_array() || v.size() != n)
      return InvalidArgument("config.json: key '", Path(key), "' must be a list of ", n, " layer types");
    out->clear();
    for (size_t i = 0; i < n; ++i) {
      if (v[i] == true_name) out->push_back(true);
      else if (v[i] == false_name) out->push_back(false);
      else
        return InvalidArgument("config.json: key '", Path(key), "[", i, "]' must be \"", true_name, "\" or \"",
                               false_name, "\", got ", v[i].dump());
    }
    return Status::Ok();
  }

 private:
  const json& obj_;
  std::string prefix_;
};

// Reads the first of several alternative key names that is present (docs/MODEL.md §1).
template <class T>
Status IntAlt(const KeyReader& r, std::initializer_list<const char*> keys, T* out, bool required, int64_t min_value) {
  for (const char* k : keys)
    if (r.Has(k)) return r.Int(k, out, true, min_value);
  if (required) return NotFound("config.json: required key '", r.Path(*keys.begin()), "' is missing");
  return Status::Ok();
}

// The object holding the text model's keys: the root, or its `text_config` in the VL layout (then
// *prefix names it in every error and c->vl_layout is set). The root and text_config must be objects.
Status FindTextConfig(const json& root, ModelConfig* c, const json** tc, std::string* prefix) {
  if (!root.is_object()) return InvalidArgument("config.json: not a JSON object");
  *tc = &root;
  if (root.contains("text_config")) {
    if (!root["text_config"].is_object()) return InvalidArgument("config.json: key 'text_config' must be an object");
    *tc = &root["text_config"];
    *prefix = "text_config.";
    c->vl_layout = true;
  }
  return Status::Ok();
}

// Widths, heads, vocabulary, context and norms. head_dim defaults to hidden / heads (which must
// then divide), rms_norm_eps must be > 0, and the query heads a multiple of the KV heads.
Status ReadBackbone(const KeyReader& r, ModelConfig* c) {
  M3_RETURN_IF_ERROR(r.Int("hidden_size", &c->hidden_size, true, 1));
  M3_RETURN_IF_ERROR(r.Int("num_hidden_layers", &c->num_layers, true, 1));
  M3_RETURN_IF_ERROR(r.Int("num_attention_heads", &c->num_heads, true, 1));
  c->num_kv_heads = c->num_heads;
  M3_RETURN_IF_ERROR(r.Int("num_key_value_heads", &c->num_kv_heads, false, 1));
  if (!r.Has("head_dim") && c->hidden_size % c->num_heads != 0)
    return NotFound("config.json: key '", r.Path("head_dim"), "' is missing and hidden_size is not divisible by num_attention_heads");
  c->head_dim = c->hidden_size / c->num_heads;
  M3_RETURN_IF_ERROR(r.Int("head_dim", &c->head_dim, false, 2));
  M3_RETURN_IF_ERROR(r.Int("vocab_size", &c->vocab_size, true, 1));
  c->max_position_embeddings = 1 << 20;
  M3_RETURN_IF_ERROR(r.Int("max_position_embeddings", &c->max_position_embeddings, false, 1));
  M3_RETURN_IF_ERROR(r.Float("rms_norm_eps", &c->rms_norm_eps, false));
  if (!(c->rms_norm_eps > 0)) return InvalidArgument("config.json: key '", r.Path("rms_norm_eps"), "' must be > 0");
  M3_RETURN_IF_ERROR(r.Bool("use_gemma_norm", &c->gemma_norm, false));
  M3_RETURN_IF_ERROR(r.Bool("use_qk_norm", &c->qk_norm, false));
  M3_RETURN_IF_ERROR(r.Bool("tie_word_embeddings", &c->tie_word_embeddings, false));
  if (c->num_heads % c->num_kv_heads != 0)
    return InvalidArgument("config.json: '", r.Path("num_attention_heads"), "' (", c->num_heads,
                           ") must be a multiple of '", r.Path("num_key_value_heads"), "' (", c->num_kv_heads, ")");
  return Status::Ok();
}

// Unsupported variants are refused rather than silently computed wrong: an attention output gate,
// qk norms other than per head, activations other than swigluoai, routing scores other than
// sigmoid, RoPE scaling other than "default".
Status RefuseUnsupportedVariants(const KeyReader& r) {
  bool gate = false;
  M3_RETURN_IF_ERROR(r.Bool("attention_output_gate", &gate, false));
  if (gate) return Unsupported("config.json: '", r.Path("attention_output_gate"), "' = true is not supported (MiniMax-M3 has no output gate)");
  std::string s = "per_head";
  M3_RETURN_IF_ERROR(r.String("qk_norm_type", &s, false));
  if (s != "per_head") return Unsupported("config.json: '", r.Path("qk_norm_type"), "' = \"", s, "\" is not supported (only \"per_head\")");
  s = "swigluoai";
  M3_RETURN_IF_ERROR(r.String("hidden_act", &s, false));
  if (s != "swigluoai" && s != "silu")  // HF-normalized configs rewrite the name to "silu" (docs/MODEL.md §1)
    return Unsupported("config.json: '", r.Path("hidden_act"), "' = \"", s, "\" is not supported (only \"swigluoai\")");
  s = "sigmoid";
  M3_RETURN_IF_ERROR(r.String("scoring_func", &s, false));
  if (s != "sigmoid") return Unsupported("config.json: '", r.Path("scoring_func"), "' = \"", s, "\" is not supported (only \"sigmoid\")");
  if (r.Has("rope_scaling")) {
    const json& rs = r.Raw("rope_scaling");
    std::string type = "?";
    for (const char* key : {"rope_type", "type"})
      if (rs.is_object() && rs.contains(key)) {
        type = rs[key].is_string() ? rs[key].get<std::string>() : rs[key].dump();
        break;
      }
    if (!rs.is_object())
      return InvalidArgument("config.json: key '", r.Path("rope_scaling"), "' must be an object, got ", rs.dump());
    if (type != "default") return Unsupported("config.json: '", r.Path("rope_scaling"), "' of type \"", type, "\" is not supported");
  }
  return Status::Ok();
}

// RoPE: theta (> 1; top level or under rope_parameters) and the rotated width, from rotary_dim or
// partial_rotary_factor (in (0, 1]; the two must agree), else head_dim; even and <= head_dim.
Status ReadRope(const KeyReader& r, const std::string& prefix, ModelConfig* c) {
  const json* rope_params = r.Has("rope_parameters") && r.Raw("rope_parameters").is_object() ? &r.Raw("rope_parameters") : nullptr;
  c->rope_theta = 0;
  if (r.Has("rope_theta")) {
    M3_RETURN_IF_ERROR(r.Number("rope_theta", &c->rope_theta, true));
  } else if (rope_params) {
    M3_RETURN_IF_ERROR(KeyReader(*rope_params, prefix + "rope_parameters.").Number("rope_theta", &c->rope_theta, true));
  } else {
    return NotFound("config.json: required key '", r.Path("rope_theta"), "' is missing");
  }
  if (!(c->rope_theta > 1)) return InvalidArgument("config.json: key '", r.Path("rope_theta"), "' must be > 1");
  double prf = 0;
  bool has_prf = r.Has("partial_rotary_factor");
  M3_RETURN_IF_ERROR(r.Number("partial_rotary_factor", &prf, false));
  if (!has_prf && rope_params && rope_params->contains("partial_rotary_factor")) {
    has_prf = true;
    M3_RETURN_IF_ERROR(KeyReader(*rope_params, prefix + "rope_parameters.").Number("partial_rotary_factor", &prf, true));
  }
  if (has_prf && !(prf > 0 && prf <= 1))
    return InvalidArgument("config.json: key '", r.Path("partial_rotary_factor"), "' must be in (0, 1], got ", prf);
  if (r.Has("rotary_dim")) {
    M3_RETURN_IF_ERROR(r.Int("rotary_dim", &c->rotary_dim, true, 0));
    if (has_prf && static_cast<int>(c->head_dim * prf) != c->rotary_dim)
      return InvalidArgument("config.json: '", r.Path("rotary_dim"), "' (", c->rotary_dim, ") disagrees with '",
                             r.Path("partial_rotary_factor"), "' (", prf, ") x head_dim (", c->head_dim, ")");
  } else if (has_prf) {
    c->rotary_dim = static_cast<int>(c->head_dim * prf);
  } else {
    c->rotary_dim = c->head_dim;
  }
  if (c->rotary_dim % 2 != 0 || c->rotary_dim > c->head_dim)
    return InvalidArgument("config.json: rotary width ", c->rotary_dim, " must be even and <= head_dim ", c->head_dim);
  return Status::Ok();
}

// The SwiGLU-OAI activation's constants; the clamp limit must be > 0.
Status ReadSwiglu(const KeyReader& r, ModelConfig* c) {
  M3_RETURN_IF_ERROR(r.Float("swiglu_alpha", &c->swiglu_alpha, false));
  M3_RETURN_IF_ERROR(r.Float("swiglu_limit", &c->swiglu_limit, false));
  M3_RETURN_IF_ERROR(r.Float("swiglu_beta", &c->swiglu_beta, false));
  if (!(c->swiglu_limit > 0)) return InvalidArgument("config.json: key '", r.Path("swiglu_limit"), "' must be > 0");
  return Status::Ok();
}

// Which layers are MoE: moe_layer_freq (0/1 per layer) or mlp_layer_types ("sparse"/"dense"),
// one entry per layer; one of them is required (docs/MODEL.md §1).
Status ReadMoeLayers(const KeyReader& r, ModelConfig* c) {
  const size_t n = static_cast<size_t>(c->num_layers);
  if (r.Has("moe_layer_freq")) {
    M3_RETURN_IF_ERROR(r.Flags("moe_layer_freq", n, &c->moe_layer));
  } else if (r.Has("mlp_layer_types")) {
    M3_RETURN_IF_ERROR(r.TypeNames("mlp_layer_types", n, "sparse", "dense", &c->moe_layer));
  } else {
    return NotFound("config.json: required key '", r.Path("moe_layer_freq"), "' is missing");
  }
  return Status::Ok();
}

// A sparse-attention integer under the first present of `keys`, in sparse_attention_config or
// (normalized names, index_*) at the top level of the text config.
Status SparseInt(const KeyReader& sr, const KeyReader& r, std::initializer_list<const char*> keys, int* out,
                 bool required, int64_t min_value) {
  for (const char* k : keys) {
    if (sr.Has(k)) return sr.Int(k, out, true, min_value);
    if (r.Has(k)) return r.Int(k, out, true, min_value);
  }
  if (required) return NotFound("config.json: required key '", sr.Path(*keys.begin()), "' is missing");
  return Status::Ok();
}

// The lightning indexer's shape, when any layer is sparse: index heads dividing the query heads,
// an index width holding the rotary width, max scoring, and no index value branch.
Status ReadIndexer(const KeyReader& r, const KeyReader& sr, ModelConfig* c) {
  const size_t n = static_cast<size_t>(c->num_layers);
  SparseAttentionConfig& sp = c->sparse;
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_num_index_heads", "index_n_heads"}, &sp.num_index_heads, true, 1));
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_index_dim", "index_head_dim"}, &sp.index_dim, true, 2));
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_block_size", "index_block_size"}, &sp.block_size, true, 1));
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_topk_blocks", "index_topk_blocks"}, &sp.topk_blocks, true, 1));
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_init_block", "index_init_blocks"}, &sp.init_blocks, false, 0));
  M3_RETURN_IF_ERROR(SparseInt(sr, r, {"sparse_local_block", "index_local_blocks"}, &sp.local_blocks, false, 0));
  std::string score = "max";
  M3_RETURN_IF_ERROR(sr.String("sparse_score_type", &score, false));
  if (score != "max")
    return Unsupported("config.json: '", sr.Path("sparse_score_type"), "' = \"", score,
                       "\" is not supported (only \"max\")");
  if (sr.Has("sparse_disable_index_value")) {
    std::vector<bool> disable;
    M3_RETURN_IF_ERROR(sr.Flags("sparse_disable_index_value", n, &disable));
    for (size_t l = 0; l < n; ++l)
      if (c->sparse_layer[l] && !disable[l])
        return Unsupported("config.json: '", sr.Path("sparse_disable_index_value"), "[", l,
                           "]' = 0 asks for an index value/output branch, which MiniMax-M3 does not have");
  }
  if (c->num_heads % sp.num_index_heads != 0)
    return InvalidArgument("config.json: num_attention_heads (", c->num_heads, ") must be a multiple of '",
                           sr.Path("sparse_num_index_heads"), "' (", sp.num_index_heads, ")");
  if (c->rotary_dim > sp.index_dim)
    return InvalidArgument("config.json: rotary width ", c->rotary_dim, " exceeds '", sr.Path("sparse_index_dim"),
                           "' (", sp.index_dim, ")");
  return Status::Ok();
}

// Sparse attention: which layers use it (sparse_attention_config.sparse_attention_freq, else
// layer_types; none when use_sparse_attention is false), then the indexer where any does.
Status ReadSparseAttention(const KeyReader& r, const std::string& prefix, ModelConfig* c) {
  const size_t n = static_cast<size_t>(c->num_layers);
  const json empty = json::object();
  const json& sc_json = r.Has("sparse_attention_config") ? r.Raw("sparse_attention_config") : empty;
  if (!sc_json.is_object()) return InvalidArgument("config.json: key '", r.Path("sparse_attention_config"), "' must be an object");
  const KeyReader sr(sc_json, prefix + "sparse_attention_config.");
  bool use_sparse = true;
  M3_RETURN_IF_ERROR(sr.Bool("use_sparse_attention", &use_sparse, false));
  c->sparse_layer.assign(n, false);
  if (sr.Has("sparse_attention_freq")) {
    M3_RETURN_IF_ERROR(sr.Flags("sparse_attention_freq", n, &c->sparse_layer));
  } else if (r.Has("layer_types")) {
    M3_RETURN_IF_ERROR(r.TypeNames("layer_types", n, "minimax_m3_sparse", "full_attention", &c->sparse_layer));
  }
  if (!use_sparse) c->sparse_layer.assign(n, false);
  if (c->any_sparse()) M3_RETURN_IF_ERROR(ReadIndexer(r, sr, c));
  return Status::Ok();
}

// MLP / MoE widths, as far as the layers need them: the dense MLP's width where a layer is dense;
// the experts (top-k <= experts), shared experts and routing where a layer is MoE.
Status ReadMlpWidths(const KeyReader& r, ModelConfig* c) {
  if (c->any_dense_mlp()) M3_RETURN_IF_ERROR(r.Int("dense_intermediate_size", &c->dense_intermediate_size, true, 1));
  if (!c->any_moe()) return Status::Ok();
  M3_RETURN_IF_ERROR(r.Int("intermediate_size", &c->moe_intermediate_size, true, 1));
  M3_RETURN_IF_ERROR(IntAlt(r, {"num_local_experts", "num_experts"}, &c->num_experts, true, 1));
  M3_RETURN_IF_ERROR(r.Int("num_experts_per_tok", &c->experts_per_token, true, 1));
  if (c->experts_per_token > c->num_experts)
    return InvalidArgument("config.json: '", r.Path("num_experts_per_tok"), "' (", c->experts_per_token,
                           ") exceeds the number of experts (", c->num_experts, ")");
  M3_RETURN_IF_ERROR(r.Int("n_shared_experts", &c->num_shared_experts, false, 0));
  int shared_width = c->moe_intermediate_size;
  M3_RETURN_IF_ERROR(r.Int("shared_intermediate_size", &shared_width, false, 1));
  c->shared_intermediate_size = shared_width * c->num_shared_experts;
  M3_RETURN_IF_ERROR(r.Float("routed_scaling_factor", &c->routed_scaling_factor, false));
  M3_RETURN_IF_ERROR(r.Bool("use_routing_bias", &c->use_routing_bias, false));
  return Status::Ok();
}

// Multi-token-prediction modules (optional, >= 0; either name).
Status ReadMtp(const KeyReader& r, ModelConfig* c) {
  int mtp = 0;
  M3_RETURN_IF_ERROR(IntAlt(r, {"num_mtp_modules", "num_nextn_predict_layers"}, &mtp, false, 0));
  c->num_mtp_modules = mtp;
  return Status::Ok();
}

}  // namespace

bool ModelConfig::any_sparse() const { return std::find(sparse_layer.begin(), sparse_layer.end(), true) != sparse_layer.end(); }
bool ModelConfig::any_moe() const { return std::find(moe_layer.begin(), moe_layer.end(), true) != moe_layer.end(); }
bool ModelConfig::any_dense_mlp() const { return std::find(moe_layer.begin(), moe_layer.end(), false) != moe_layer.end(); }

// The steps in order: each reads its group of keys and checks them against what earlier steps
// read, so the first problem in that order is the one reported.
StatusOr<ModelConfig> ParseModelConfig(const json& root) {
  ModelConfig c;
  const json* tc = nullptr;
  std::string prefix;
  M3_RETURN_IF_ERROR(FindTextConfig(root, &c, &tc, &prefix));
  const KeyReader r(*tc, prefix);
  M3_RETURN_IF_ERROR(ReadBackbone(r, &c));
  M3_RETURN_IF_ERROR(RefuseUnsupportedVariants(r));
  M3_RETURN_IF_ERROR(ReadRope(r, prefix, &c));
  M3_RETURN_IF_ERROR(ReadSwiglu(r, &c));
  M3_RETURN_IF_ERROR(ReadMoeLayers(r, &c));
  M3_RETURN_IF_ERROR(ReadSparseAttention(r, prefix, &c));
  M3_RETURN_IF_ERROR(ReadMlpWidths(r, &c));
  M3_RETURN_IF_ERROR(ReadMtp(r, &c));
  return c;
}

KvCacheShape CacheShapeOf(const ModelConfig& c) {
  KvCacheShape shape;
  shape.kv_heads = static_cast<size_t>(c.num_kv_heads);
  shape.head_dim = static_cast<size_t>(c.head_dim);
  shape.index_dim = static_cast<size_t>(c.sparse.index_dim);
  shape.page_rows = c.any_sparse() ? static_cast<size_t>(c.sparse.block_size) : 64;
  shape.sparse_layer = c.sparse_layer;
  return shape;
}

}  // namespace m3
