#include "model/weights.h"

#include <algorithm>
#include <limits>
#include <set>

#include "ops/convert.h"

namespace m3 {
namespace {

using simd::WeightFormat;
using simd::WeightRef;

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

struct Visitor {
  const ModelConfig& cfg;
  const std::function<void(TensorSlot&)>& fn;

  void Matrix(const std::string& name, int64_t rows, int64_t cols, WeightRef* out, bool expert = false) {
    TensorSlot s;
    s.name = name;
    s.shape = {rows, cols};
    s.matrix = out;
    s.is_routed_expert = expert;
    fn(s);
  }
  void Vector(const std::string& name, int64_t n, std::vector<float>* out, bool norm) {
    TensorSlot s;
    s.name = name;
    s.shape = {n};
    s.vector = out;
    s.is_norm = norm;
    fn(s);
  }
  void Mlp(const std::string& p, const char* g, const char* u, const char* d, int64_t inter, MlpWeights* w,
           bool expert = false) {
    const int64_t H = cfg.hidden_size;
    Matrix(p + g + ".weight", inter, H, &w->gate, expert);
    Matrix(p + u + ".weight", inter, H, &w->up, expert);
    Matrix(p + d + ".weight", H, inter, &w->down, expert);
  }
  void Layer(const std::string& p, bool sparse, bool moe, LayerWeights* L) {
    const int64_t H = cfg.hidden_size, D = cfg.head_dim;
    Vector(p + "input_layernorm.weight", H, &L->input_norm, true);
    Vector(p + "post_attention_layernorm.weight", H, &L->post_norm, true);
    AttentionWeights& a = L->attn;
    const std::string sa = p + "self_attn.";
    Matrix(sa + "q_proj.weight", cfg.num_heads * D, H, &a.q);
    Matrix(sa + "k_proj.weight", cfg.num_kv_heads * D, H, &a.k);
    Matrix(sa + "v_proj.weight", cfg.num_kv_heads * D, H, &a.v);
    Matrix(sa + "o_proj.weight", H, cfg.num_heads * D, &a.o);
    if (cfg.qk_norm) {
      Vector(sa + "q_norm.weight", D, &a.q_norm, true);
      Vector(sa + "k_norm.weight", D, &a.k_norm, true);
    }
    a.sparse = sparse;
    if (sparse) {
      const int64_t Di = cfg.sparse.index_dim;
      Matrix(sa + "index_q_proj.weight", cfg.sparse.num_index_heads * Di, H, &a.index_q);
      Matrix(sa + "index_k_proj.weight", Di, H, &a.index_k);
      Vector(sa + "index_q_norm.weight", Di, &a.index_q_norm, true);
      Vector(sa + "index_k_norm.weight", Di, &a.index_k_norm, true);
    }
    L->is_moe = moe;
    if (!moe) {
      Mlp(p + "mlp.", "gate_proj", "up_proj", "down_proj", cfg.dense_intermediate_size, &L->mlp);
      return;
    }
    const std::string m = p + "block_sparse_moe.";
    Matrix(m + "gate.weight", cfg.num_experts, H, &L->moe.router);
    if (cfg.use_routing_bias) Vector(m + "e_score_correction_bias", cfg.num_experts, &L->moe.router_bias, false);
    L->moe.experts.resize(cfg.num_experts);
    for (int e = 0; e < cfg.num_experts; ++e)
      Mlp(m + "experts." + std::to_string(e) + ".", "w1", "w3", "w2", cfg.moe_intermediate_size, &L->moe.experts[e], true);
    L->moe.has_shared = cfg.shared_intermediate_size > 0;
    if (L->moe.has_shared)
      Mlp(m + "shared_experts.", "gate_proj", "up_proj", "down_proj", cfg.shared_intermediate_size, &L->moe.shared);
  }
};

StatusOr<WeightFormat> MatrixFormat(DType d) {
  switch (d) {
    case DType::kF32: return WeightFormat::kF32;
    case DType::kBF16: return WeightFormat::kBF16;
    case DType::kF16: return WeightFormat::kF16;
    case DType::kF8E4M3: return WeightFormat::kE4M3Mx32;
    default: return Unsupported("dtype ", DTypeName(d));
  }
}

// How many MTP depths (up to num_mtp_modules) have at least one tensor: depth d counts when
// any name starts with "model.mtp.layers.d." and every shallower depth counts.
int CountMtpDepths(const ModelConfig& cfg, const std::function<bool(const std::string& prefix)>& has_prefix) {
  int depths = 0;
  while (depths < cfg.num_mtp_modules && has_prefix("model.mtp.layers." + std::to_string(depths) + ".")) ++depths;
  return depths;
}

void CountParams(const TensorSlot& s, int64_t numel, WeightStats* stats) {
  stats->total_params += numel;
  if (s.is_routed_expert) stats->routed_expert_params += numel;
  if (s.name == "model.embed_tokens.weight") stats->embedding_params += numel;
}

// Norm weights become the (1 + w) multiplier for Gemma-style norms, formed once in fp32.
void PrepareVector(const ModelConfig& cfg, TensorSlot& s) {
  if (s.is_norm && cfg.gemma_norm)
    for (float& x : *s.vector) x = 1.0f + x;
}

Status UnexplainedTensor(const ModelConfig& cfg, const std::string& where, const std::string& name) {
  if (name.find(".mtp.") != std::string::npos || name.rfind("mtp.", 0) == 0)
    return InvalidArgument(where, ": tensor '", name, "' belongs to an MTP depth beyond num_mtp_modules (",
                           cfg.num_mtp_modules, ") or an incomplete MTP module");
  return InvalidArgument(where, ": tensor '", name, "' is not part of the model that config.json describes");
}

// Tied LM head, zero router bias where unused, and the active-parameter count.
void FinishBinding(const ModelConfig& cfg, ModelWeights* w, WeightStats* stats) {
  if (cfg.tie_word_embeddings) w->lm_head = w->embed;
  for (auto& L : w->layers)
    if (L.is_moe && !cfg.use_routing_bias) L.moe.router_bias.assign(cfg.num_experts, 0.0f);
  for (auto& m : w->mtp)
    if (m.layer.is_moe && !cfg.use_routing_bias) m.layer.moe.router_bias.assign(cfg.num_experts, 0.0f);
  const int64_t H = cfg.hidden_size;
  stats->active_params = stats->total_params - stats->embedding_params + H;
  if (cfg.num_experts > 0)
    stats->active_params -= stats->routed_expert_params * (cfg.num_experts - cfg.experts_per_token) / cfg.num_experts;
  if (cfg.tie_word_embeddings) stats->active_params += stats->embedding_params - H;  // the LM head reads it all
}

}  // namespace

StatusOr<simd::WeightFormat> CheckpointWeightFormat(DType d) { return MatrixFormat(d); }

void ForEachTensor(const ModelConfig& cfg, int mtp_depths, ModelWeights* w,
                   const std::function<void(TensorSlot&)>& fn) {
  Visitor v{cfg, fn};
  const int64_t H = cfg.hidden_size;
  v.Matrix("model.embed_tokens.weight", cfg.vocab_size, H, &w->embed);
  if (!cfg.tie_word_embeddings) v.Matrix("lm_head.weight", cfg.vocab_size, H, &w->lm_head);
  v.Vector("model.norm.weight", H, &w->final_norm, true);
  w->layers.resize(cfg.num_layers);
  for (int l = 0; l < cfg.num_layers; ++l)
    v.Layer("model.layers." + std::to_string(l) + ".", cfg.sparse_layer[l], cfg.moe_layer[l], &w->layers[l]);
  w->mtp.resize(mtp_depths);
  for (int d = 0; d < mtp_depths; ++d) {
    const std::string p = "model.mtp.layers." + std::to_string(d) + ".";
    MtpWeights& m = w->mtp[d];
    v.Vector(p + "enorm.weight", H, &m.enorm, true);
    v.Vector(p + "hnorm.weight", H, &m.hnorm, true);
    v.Matrix(p + "eh_proj.weight", H, 2 * H, &m.eh_proj);
    v.Vector(p + "final_layernorm.weight", H, &m.final_norm, true);
    // The MTP transformer layer is always sparse attention + MoE (docs/MODEL.md §5).
    v.Layer(p + "transformer_layer.", cfg.any_sparse(), cfg.any_moe(), &m.layer);
  }
}

StatusOr<WeightStats> BindWeights(const ModelConfig& cfg, const Checkpoint& ck, ModelWeights* w) {
  // MXFP8 block shape, when declared, must be the [1, 32] the kernels read.
  const nlohmann::json& root = ck.config_json();
  const nlohmann::json* qc = nullptr;
  if (root.contains("quantization_config")) qc = &root["quantization_config"];
  else if (root.contains("text_config") && root["text_config"].is_object() && root["text_config"].contains("quantization_config"))
    qc = &root["text_config"]["quantization_config"];
  if (qc && qc->is_object() && qc->contains("weight_block_size")) {
    const auto& b = (*qc)["weight_block_size"];
    if (!(b.is_array() && b.size() == 2 && b[0] == 1 && b[1] == 32))
      return Unsupported("config.json: quantization_config.weight_block_size ", b.dump(), " is not supported (only [1, 32])");
  }

  const int depths = CountMtpDepths(cfg, [&](const std::string& p) {
    auto it = ck.text_tensors().lower_bound(p);
    return it != ck.text_tensors().end() && it->first.rfind(p, 0) == 0;
  });

  WeightStats stats;
  stats.mtp_depths = depths;
  std::set<std::string> used;
  Status status;
  ForEachTensor(cfg, depths, w, [&](TensorSlot& s) {
    if (!status.ok()) return;
    const TensorInfo* t = ck.Find(s.name);
    if (!t) {
      status = NotFound(ck.dir(), ": tensor '", s.name, "' ", ShapeStr(s.shape), " is missing from the checkpoint");
      return;
    }
    used.insert(s.name);
    if (t->shape != s.shape) {
      status = InvalidArgument(ck.dir(), ": tensor '", s.name, "' (", t->file->path(), ") has shape ", t->ShapeString(),
                               " but config.json implies ", ShapeStr(s.shape));
      return;
    }
    const int64_t numel = t->numel();
    CountParams(s, numel, &stats);

    if (s.vector) {
      if (t->dtype != DType::kF32 && t->dtype != DType::kBF16 && t->dtype != DType::kF16) {
        status = Unsupported(ck.dir(), ": tensor '", s.name, "' has dtype ", DTypeName(t->dtype), "; expected F32, BF16 or F16");
        return;
      }
      WeightRef ref{*MatrixFormat(t->dtype), t->data, nullptr, 1, static_cast<size_t>(numel)};
      s.vector->resize(numel);
      for (int64_t i = 0; i < numel; ++i) (*s.vector)[i] = simd::WeightAt(ref, 0, static_cast<size_t>(i));
      PrepareVector(cfg, s);
      return;
    }
    auto fmt = MatrixFormat(t->dtype);
    if (!fmt.ok()) {
      status = Unsupported(ck.dir(), ": tensor '", s.name, "' has dtype ", DTypeName(t->dtype),
                           "; weights must be F32, BF16, F16 or F8_E4M3 with E8M0 block scales");
      return;
    }
    WeightRef& ref = *s.matrix;
    ref = WeightRef{*fmt, t->data, nullptr, static_cast<size_t>(s.shape[0]), static_cast<size_t>(s.shape[1])};
    if (*fmt == WeightFormat::kE4M3Mx32) {
      const std::string sname = s.name + "_scale_inv";
      const TensorInfo* sc = ck.Find(sname);
      if (!sc) {
        status = NotFound(ck.dir(), ": FP8 tensor '", s.name, "' has no block-scale tensor '", sname, "'");
        return;
      }
      used.insert(sname);
      const std::vector<int64_t> want = {s.shape[0], static_cast<int64_t>(ref.scale_cols())};
      if ((sc->dtype != DType::kU8 && sc->dtype != DType::kF8E8M0) || sc->shape != want) {
        status = InvalidArgument(ck.dir(), ": scale tensor '", sname, "' is ", DTypeName(sc->dtype), " ", sc->ShapeString(),
                                 "; MXFP8 needs U8/F8_E8M0 ", ShapeStr(want), " (one E8M0 exponent per 32 inputs)");
        return;
      }
      ref.scales = sc->data;
    }
  });
  M3_RETURN_IF_ERROR(status);
  for (const auto& [name, info] : ck.text_tensors())
    if (!used.count(name)) return UnexplainedTensor(cfg, ck.dir(), name);
  FinishBinding(cfg, w, &stats);
  return stats;
}

StatusOr<WeightStats> BindPackedWeights(const ModelConfig& cfg, const PackFile& pack, ModelWeights* w) {
  const int depths = CountMtpDepths(cfg, [&](const std::string& p) { return pack.HasPrefix(p); });
  WeightStats stats;
  stats.mtp_depths = depths;
  std::set<std::string> used;
  Status status;
  ForEachTensor(cfg, depths, w, [&](TensorSlot& s) {
    if (!status.ok()) return;
    const PackedTensor* t = pack.Find(s.name);
    if (!t) {
      status = NotFound(pack.path(), ": tensor '", s.name, "' ", ShapeStr(s.shape), " is missing from the packed file");
      return;
    }
    used.insert(s.name);
    // A 1-D tensor of n values is stored as [1, n].
    const int64_t rows = static_cast<int64_t>(t->rows), cols = static_cast<int64_t>(t->cols);
    const bool shape_ok = s.vector ? (rows == 1 && cols == s.shape[0]) : (rows == s.shape[0] && cols == s.shape[1]);
    if (!shape_ok) {
      const std::string stored = s.vector && rows == 1 ? Str("[", cols, "]") : Str("[", rows, ", ", cols, "]");
      status = InvalidArgument(pack.path(), ": tensor '", s.name, "' has shape ", stored, " but config.json implies ",
                               ShapeStr(s.shape));
      return;
    }
    CountParams(s, static_cast<int64_t>(t->numel()), &stats);
    if (s.vector) {
      if (t->format != WeightFormat::kF32) {
        status = Corrupt(pack.path(), ": tensor '", s.name, "' is ", simd::WeightFormatName(t->format),
                         "; vectors are stored as f32");
        return;
      }
      *s.vector = pack.F32Values(*t);
      PrepareVector(cfg, s);
      return;
    }
    *s.matrix = pack.Weight(*t);  // used in place from the mapping
  });
  M3_RETURN_IF_ERROR(status);
  for (const auto& t : pack.tensors())
    if (!used.count(t.name)) return UnexplainedTensor(cfg, pack.path(), t.name);
  // Each routed expert's byte range, so the MoE can ask for the chosen ones ahead of use.
  auto bind_expert_memory = [&](int layer_index, MoeWeights* moe) {
    moe->expert_memory.assign(moe->experts.size(), {});
    for (size_t e = 0; e < moe->experts.size(); ++e)
      if (const ByteRange* r = pack.ExpertRange(layer_index, static_cast<int>(e)))
        moe->expert_memory[e] = {{pack.file().data() + r->offset, static_cast<size_t>(r->bytes)}};
  };
  for (size_t l = 0; l < w->layers.size(); ++l)
    if (w->layers[l].is_moe) bind_expert_memory(static_cast<int>(l), &w->layers[l].moe);
  for (size_t d = 0; d < w->mtp.size(); ++d)
    if (w->mtp[d].layer.is_moe) bind_expert_memory(cfg.num_layers + static_cast<int>(d), &w->mtp[d].layer.moe);
  FinishBinding(cfg, w, &stats);
  return stats;
}

Status VerifyFiniteValues(const Checkpoint& ck, const ThreadConfig& tc) {
  constexpr size_t kChunk = size_t{1} << 20;  // values per step and thread
  for (const auto& entry : ck.text_tensors()) {
    const auto& name = entry.first;
    const auto& t = entry.second;  // (not a structured binding: clang 14's lambdas cannot capture one)
    const bool e8m0 = t->dtype == DType::kF8E8M0 || (t->dtype == DType::kU8 && name.ends_with("_scale_inv"));
    const bool e4m3 = t->dtype == DType::kF8E4M3;
    const auto fmt = MatrixFormat(t->dtype);
    if (!e8m0 && !e4m3 && !fmt.ok()) continue;  // integer tensors: every bit pattern is a value
    const size_t n = static_cast<size_t>(t->numel()), bytes_per = t->nbytes / std::max<size_t>(1, n);
    const size_t chunks = (n + kChunk - 1) / kChunk;
    const size_t none = std::numeric_limits<size_t>::max();
    std::vector<size_t> first(static_cast<size_t>(std::max(1, tc.threads)), none);
    std::vector<std::vector<float>> buffers(first.size());
    ParallelFor(tc, chunks, 1, [&](size_t c0, size_t c1, int th) {
      for (size_t c = c0; c < c1 && first[th] == none; ++c) {
        const size_t b = c * kChunk, len = std::min(kChunk, n - b);
        size_t at = len;
        if (e8m0 || e4m3) {
          const uint8_t* v = t->data + b;
          at = static_cast<size_t>(std::find_if(v, v + len, [&](uint8_t x) {
                                     return e8m0 ? x == 0xFF : (x & 0x7F) == 0x7F;
                                   }) - v);
        } else {
          buffers[th].resize(len);
          DecodeWeightRows(WeightRef{fmt.value(), t->data + b * bytes_per, nullptr, 1, len}, 0, 1, buffers[th].data());
          at = FindNonFinite(buffers[th].data(), len);
        }
        t->file->DontNeed(static_cast<size_t>(t->data - t->file->data()) + b * bytes_per, len * bytes_per);
        if (at < len) first[th] = b + at;
      }
    });
    const size_t at = *std::min_element(first.begin(), first.end());
    if (at == none) continue;
    std::string index = std::to_string(at);
    if (t->shape.size() == 2) index = Str(at / t->shape[1], ", ", at % t->shape[1]);
    return Corrupt(t->file->path(), ": tensor '", t->name, "' holds a non-finite value at [", index, "]",
                   e8m0 ? " (an E8M0 scale of 255)" : e4m3 ? " (the E4M3 NaN code)" : "",
                   ": the checkpoint is damaged");
  }
  return Status::Ok();
}

}  // namespace m3
