#include "offload/dense_offload.h"

#include <algorithm>
#include <chrono>

#include "model/dense_part.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "ops/norm_rope.h"

namespace m3 {

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// A KvCache's rows in device memory: per layer K and V [capacity][Hkv][D], and for sparse layers
// the index keys [capacity][D_idx]. Grows by re-allocating and copying (on the device).
struct DeviceCache final : KvCache::Attached {
  Device* device = nullptr;
  size_t capacity = 0;
  std::vector<float*> k, v, ik;
  ~DeviceCache() override {
    for (auto* list : {&k, &v, &ik})
      for (float* p : *list)
        if (p) device->Free(p);
  }
};

// Stages of the non-finite flag, in pass order: the first one that went wrong is the smallest.
enum : uint32_t { kIndexQueries, kIndexKeys, kAttention, kFeedForward, kStagesPerLayer };
uint32_t EmbeddingStage() { return 0; }
uint32_t LayerStage(int layer, uint32_t what) { return 1 + static_cast<uint32_t>(layer) * kStagesPerLayer + what; }

}  // namespace

struct DenseOffload::Layer {
  float* input_norm = nullptr;
  float* post_norm = nullptr;
  DeviceMatrix q, k, v, o, index_q, index_k, router;
  float* q_norm = nullptr;  // null: no per-head norm
  float* k_norm = nullptr;
  float* index_q_norm = nullptr;
  float* index_k_norm = nullptr;
  bool sparse = false, moe = false, mlp = false;  // mlp: a dense MLP, or the MoE's shared expert
  DeviceMatrix gate, up, down;
};

// Activations of a pass on the device and their host staging (pinned), grown as passes need.
struct DenseOffload::Buffers {
  Device* device = nullptr;
  size_t rows = 0, logit_rows = 0, score_floats = 0;
  float *h = nullptr, *x = nullptr, *q = nullptr, *k = nullptr, *v = nullptr, *iq = nullptr, *ik = nullptr;
  float *core = nullptr, *g = nullptr, *u = nullptr, *routed = nullptr, *router = nullptr, *rope = nullptr;
  float *logits = nullptr, *scores = nullptr;
  int32_t* blocks = nullptr;  // per segment: its blocks [n][Hi][topk], then its counts [n][Hi]
  uint64_t* flag = nullptr;
  // Host side.
  float *host_h = nullptr, *host_x = nullptr, *host_router = nullptr, *host_routed = nullptr, *host_scores = nullptr;
  float* host_rope = nullptr;
  int32_t* host_blocks = nullptr;
  uint64_t* host_flag = nullptr;
  std::vector<void*> device_owned, host_owned;

  void FreeAll() {
    for (void* p : device_owned) device->Free(p);
    for (void* p : host_owned) device->FreeHost(p);
    device_owned.clear();
    host_owned.clear();
  }
  ~Buffers() { FreeAll(); }
};

DenseOffload::~DenseOffload() {
  buf_.reset();
  for (void* p : owned_) device_->Free(p);
}

Status DenseOffload::Upload(const std::string& what, const simd::WeightRef& w, DeviceMatrix* m) {
  if (!w.data) return Status::Ok();
  M3_ASSIGN_OR_RETURN(*m, device_->Upload(w, what));
  owned_.push_back(m->codes);
  if (m->scales) owned_.push_back(m->scales);
  weight_bytes_ += m->bytes();
  return Status::Ok();
}

Status DenseOffload::UploadVector(const std::string& what, const std::vector<float>& v, float** out) {
  if (v.empty()) return Status::Ok();
  M3_ASSIGN_OR_RETURN(void* p, device_->Allocate(v.size() * sizeof(float), what));
  owned_.push_back(p);
  device_->ToDevice(p, v.data(), v.size() * sizeof(float));
  *out = static_cast<float*>(p);
  weight_bytes_ += v.size() * sizeof(float);
  return device_->Wait();  // v is the caller's: copied before it can change
}

StatusOr<std::unique_ptr<DenseOffload>> DenseOffload::Open(const Model& model, std::unique_ptr<Device> device,
                                                           uint64_t context) {
  const ModelConfig& c = model.config();
  const ModelWeights& w = model.weights();
  // What the device will hold, in its layouts, before any of it is uploaded.
  uint64_t need = 0;
  ForEachDenseMatrix(w, /*shared_experts=*/true, /*lm_head=*/true, [&](const char* group, const simd::WeightRef& m) {
    if (std::string(group) != "MTP projection") need += DeviceLayoutFor(m).bytes();
  });
  GpuFootprint footprint = EstimateGpuFootprint(c, MeasureDensePart(c, w), CacheOptions{}, context);
  footprint.weight_bytes = need;
  M3_RETURN_IF_ERROR(CheckGpuFits(footprint, device->Describe(), device->FreeBytes()));

  std::unique_ptr<DenseOffload> o(new DenseOffload);
  o->model_ = &model;
  o->device_ = std::move(device);
  o->buf_ = std::make_unique<Buffers>();
  o->buf_->device = o->device_.get();
  o->layers_.resize(static_cast<size_t>(c.num_layers));
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    Layer& D = o->layers_[static_cast<size_t>(l)];
    const std::string at = Str("layer ", l, " ");
    D.sparse = L.attn.sparse;
    D.moe = L.is_moe;
    M3_RETURN_IF_ERROR(o->UploadVector(at + "input norm", L.input_norm, &D.input_norm));
    M3_RETURN_IF_ERROR(o->UploadVector(at + "post-attention norm", L.post_norm, &D.post_norm));
    M3_RETURN_IF_ERROR(o->Upload(at + "q_proj", L.attn.q, &D.q));
    M3_RETURN_IF_ERROR(o->Upload(at + "k_proj", L.attn.k, &D.k));
    M3_RETURN_IF_ERROR(o->Upload(at + "v_proj", L.attn.v, &D.v));
    M3_RETURN_IF_ERROR(o->Upload(at + "o_proj", L.attn.o, &D.o));
    M3_RETURN_IF_ERROR(o->UploadVector(at + "q norm", L.attn.q_norm, &D.q_norm));
    M3_RETURN_IF_ERROR(o->UploadVector(at + "k norm", L.attn.k_norm, &D.k_norm));
    if (D.sparse) {
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer q", L.attn.index_q, &D.index_q));
      M3_RETURN_IF_ERROR(o->Upload(at + "indexer k", L.attn.index_k, &D.index_k));
      M3_RETURN_IF_ERROR(o->UploadVector(at + "indexer q norm", L.attn.index_q_norm, &D.index_q_norm));
      M3_RETURN_IF_ERROR(o->UploadVector(at + "indexer k norm", L.attn.index_k_norm, &D.index_k_norm));
    }
    const MlpWeights* mlp = L.is_moe ? (L.moe.has_shared ? &L.moe.shared : nullptr) : &L.mlp;
    if (L.is_moe) M3_RETURN_IF_ERROR(o->Upload(at + "router", L.moe.router, &D.router));
    if (mlp) {
      D.mlp = true;
      M3_RETURN_IF_ERROR(o->Upload(at + "gate", mlp->gate, &D.gate));
      M3_RETURN_IF_ERROR(o->Upload(at + "up", mlp->up, &D.up));
      M3_RETURN_IF_ERROR(o->Upload(at + "down", mlp->down, &D.down));
    }
  }
  M3_RETURN_IF_ERROR(o->UploadVector("final norm", w.final_norm, &o->final_norm_));
  M3_RETURN_IF_ERROR(o->Upload("lm_head", w.lm_head, &o->lm_head_));
  M3_RETURN_IF_ERROR(o->device_->Wait());
  return o;
}

// A dense MLP, or a MoE layer's shared expert, of b.x into b.h (added).
void DenseOffload::RunMlp(const Layer& L, size_t n) {
  const ModelConfig& c = model_->config();
  Buffers& b = *buf_;
  const size_t inter = L.gate.layout.rows;
  const Device::MatMulJob gate_up[] = {{&L.gate, b.g, inter, false}, {&L.up, b.u, inter, false}};
  device_->MatMulMany(gate_up, 2, b.x, n);
  device_->Swiglu(b.g, b.u, n * inter, DeviceSwiglu{c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta});
  device_->MatMul(L.down, b.g, n, b.h, c.hidden_size, /*accumulate=*/true);
}

Status DenseOffload::EnsureBuffers(size_t rows, size_t logit_rows, size_t score_floats) {
  Buffers& b = *buf_;
  if (rows <= b.rows && logit_rows <= b.logit_rows && score_floats <= b.score_floats) return Status::Ok();
  M3_RETURN_IF_ERROR(device_->Wait());  // nothing queued still uses the old ones
  b.FreeAll();
  rows = std::max(rows, b.rows);
  logit_rows = std::max(logit_rows, b.logit_rows);
  score_floats = std::max(score_floats, b.score_floats);
  const ModelConfig& c = model_->config();
  const size_t H = c.hidden_size, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
  const size_t Hi = c.any_sparse() ? c.sparse.num_index_heads : 0, Di = c.any_sparse() ? c.sparse.index_dim : 0;
  const size_t topk = c.any_sparse() ? c.sparse.topk_blocks : 0;
  const size_t inter = std::max<size_t>(c.dense_intermediate_size, c.shared_intermediate_size);
  const size_t E = c.any_moe() ? c.num_experts : 0, V = c.vocab_size, half = c.rotary_dim / 2;
  auto dev = [&](auto** p, size_t count, const char* what) -> Status {
    M3_ASSIGN_OR_RETURN(void* a,
                        device_->Allocate(std::max<size_t>(count, 1) * sizeof(**p), Str("activations (", what, ")")));
    b.device_owned.push_back(a);
    *p = static_cast<std::remove_reference_t<decltype(*p)>>(a);
    return Status::Ok();
  };
  auto host = [&](auto** p, size_t count) -> Status {
    M3_ASSIGN_OR_RETURN(void* a, device_->AllocateHost(std::max<size_t>(count, 1) * sizeof(**p)));
    b.host_owned.push_back(a);
    *p = static_cast<std::remove_reference_t<decltype(*p)>>(a);
    return Status::Ok();
  };
  M3_RETURN_IF_ERROR(dev(&b.h, rows * H, "hidden states"));
  M3_RETURN_IF_ERROR(dev(&b.x, rows * H, "normed"));
  M3_RETURN_IF_ERROR(dev(&b.q, rows * Hq * D, "queries"));
  M3_RETURN_IF_ERROR(dev(&b.k, rows * Hkv * D, "keys"));
  M3_RETURN_IF_ERROR(dev(&b.v, rows * Hkv * D, "values"));
  M3_RETURN_IF_ERROR(dev(&b.iq, rows * Hi * Di, "index queries"));
  M3_RETURN_IF_ERROR(dev(&b.ik, rows * Di, "index keys"));
  M3_RETURN_IF_ERROR(dev(&b.core, rows * Hq * D, "attention"));
  M3_RETURN_IF_ERROR(dev(&b.g, rows * inter, "gate"));
  M3_RETURN_IF_ERROR(dev(&b.u, rows * inter, "up"));
  M3_RETURN_IF_ERROR(dev(&b.routed, rows * H, "routed experts"));
  M3_RETURN_IF_ERROR(dev(&b.router, rows * E, "router logits"));
  M3_RETURN_IF_ERROR(dev(&b.rope, rows * half * 2, "rope"));
  M3_RETURN_IF_ERROR(dev(&b.logits, logit_rows * V, "logits"));
  M3_RETURN_IF_ERROR(dev(&b.scores, score_floats, "block scores"));
  M3_RETURN_IF_ERROR(dev(&b.blocks, rows * Hi * (topk + 1), "selected blocks"));
  M3_RETURN_IF_ERROR(dev(&b.flag, 1, "flag"));
  M3_RETURN_IF_ERROR(host(&b.host_h, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_x, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_router, rows * E));
  M3_RETURN_IF_ERROR(host(&b.host_routed, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_scores, score_floats));
  M3_RETURN_IF_ERROR(host(&b.host_rope, rows * half * 2));
  M3_RETURN_IF_ERROR(host(&b.host_blocks, rows * Hi * (topk + 1)));
  M3_RETURN_IF_ERROR(host(&b.host_flag, 1));
  b.rows = rows;
  b.logit_rows = logit_rows;
  b.score_floats = score_floats;
  return Status::Ok();
}

namespace {

// The device rows of `cache`, with room for `rows` positions.
StatusOr<DeviceCache*> EnsureDeviceCache(Device& device, const ModelConfig& c, KvCache* cache, size_t rows) {
  auto* dc = dynamic_cast<DeviceCache*>(cache->attached().get());
  if (dc && dc->device != &device) dc = nullptr;
  if (!dc) {
    auto fresh = std::make_unique<DeviceCache>();
    fresh->device = &device;
    const size_t L = static_cast<size_t>(c.num_layers);
    fresh->k.assign(L, nullptr);
    fresh->v.assign(L, nullptr);
    fresh->ik.assign(L, nullptr);
    dc = fresh.get();
    cache->attached() = std::move(fresh);
  }
  if (rows <= dc->capacity) return dc;
  const size_t cap = (std::max({rows, dc->capacity + dc->capacity / 2, size_t{256}}) + 255) / 256 * 256;
  const size_t kv = static_cast<size_t>(c.num_kv_heads) * c.head_dim, idx = static_cast<size_t>(c.sparse.index_dim);
  M3_RETURN_IF_ERROR(device.Wait());  // the old rows are read no more once copied
  for (size_t l = 0; l < dc->k.size(); ++l) {
    auto grow = [&](float*& p, size_t width) -> Status {
      M3_ASSIGN_OR_RETURN(void* fresh, device.Allocate(cap * width * sizeof(float),
                                                       Str("the caches of ", cap, " tokens (layer ", l, ")")));
      if (p) {
        device.Copy(fresh, p, dc->capacity * width * sizeof(float));
        M3_RETURN_IF_ERROR(device.Wait());
        device.Free(p);
      }
      p = static_cast<float*>(fresh);
      return Status::Ok();
    };
    M3_RETURN_IF_ERROR(grow(dc->k[l], kv));
    M3_RETURN_IF_ERROR(grow(dc->v[l], kv));
    if (c.sparse_layer[l]) M3_RETURN_IF_ERROR(grow(dc->ik[l], idx));
  }
  dc->capacity = cap;
  return dc;
}

}  // namespace

Status DenseOffload::Forward(const OpContext& tc, std::span<const Model::Segment> segments, LogitsMode mode,
                             float* logits, ForwardObserver* observer) {
  const std::lock_guard<std::mutex> lock(pass_);
  const double t_start = Now();
  const ModelConfig& c = model_->config();
  const ModelWeights& weights = model_->weights();
  const size_t H = c.hidden_size, Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, V = c.vocab_size;
  const SparseParams& sp = c.sparse;
  const size_t Hi = c.any_sparse() ? sp.num_index_heads : 0, Di = c.any_sparse() ? sp.index_dim : 0;
  const size_t B = static_cast<size_t>(sp.block_size), topk = c.any_sparse() ? sp.topk_blocks : 0;
  const size_t E = c.num_experts, K = static_cast<size_t>(c.experts_per_token), half = c.rotary_dim / 2;
  M3_ASSIGN_OR_RETURN(Model::PassRows rows_of_pass, Model::LayOutPass(segments));
  const std::vector<int64_t>& positions = rows_of_pass.positions;
  const std::vector<int32_t>& ids = rows_of_pass.ids;
  std::vector<size_t> logit_rows;  // every row (kAllRows), each segment's last ones (kLastRow), or none
  if (mode == LogitsMode::kAllRows)
    for (size_t r = 0; r < ids.size(); ++r) logit_rows.push_back(r);
  else if (mode == LogitsMode::kLastRow)
    logit_rows = rows_of_pass.logit_rows;
  for (const Model::Segment& s : segments)
    if (s.cache->options().kv != CacheType::kF32 || s.cache->options().index_keys != CacheType::kF32)
      return Unsupported("the offloaded dense part keeps its caches in f32 on the device: a session with ",
                         CacheTypeName(s.cache->options().kv), " K/V or ", CacheTypeName(s.cache->options().index_keys),
                         " index keys cannot run on it");
  const size_t n = ids.size();
  // Block scores of at most 16M floats at a time (queries of a long prompt in parts).
  size_t max_blocks = 1;
  for (const int64_t p : positions) max_blocks = std::max(max_blocks, static_cast<size_t>(p) / B + 1);
  const size_t score_rows = Hi ? std::max<size_t>(1, std::min(n, (size_t{1} << 24) / (Hi * max_blocks))) : 0;
  constexpr size_t kLogitChunk = 256;
  M3_RETURN_IF_ERROR(EnsureBuffers(n, std::min(logit_rows.size(), kLogitChunk), score_rows * Hi * max_blocks));
  Buffers& b = *buf_;
  Device& dev = *device_;
  std::vector<DeviceCache*> caches;
  for (const Model::Segment& s : segments) {
    M3_ASSIGN_OR_RETURN(DeviceCache * dc, EnsureDeviceCache(dev, c, s.cache, s.cache->length() + s.n));
    caches.push_back(dc);
  }
  // The device's busy time: marks around each stretch of queued work (a stretch ends where the
  // host waits for its result and the next begins once the host has queued more), read at the end.
  dev.ResetMarks();
  std::vector<std::pair<int, int>> busy, shared;
  double experts_seconds = 0, selection_seconds = 0;
  int segment_start = dev.Mark();
  auto end_stretch = [&] { busy.emplace_back(segment_start, dev.Mark()); };

  // Embedding rows (exact, on the host: a token reads one row of the table), RoPE rotations.
  GatherRows(weights.embed, ids.data(), n, b.host_h);
  for (size_t t = 0; t < n; ++t) model_->rope().CosSin(positions[t], b.host_rope + t * half * 2);
  *b.host_flag = ~uint64_t{0};
  dev.ToDevice(b.h, b.host_h, n * H * sizeof(float));
  dev.ToDevice(b.rope, b.host_rope, n * half * 2 * sizeof(float));
  dev.ToDevice(b.flag, b.host_flag, sizeof(uint64_t));
  dev.FlagNonFinite(b.h, n, H, EmbeddingStage(), b.flag);

  const MoeParams moe_params{c.experts_per_token,
                             c.routed_scaling_factor,
                             c.use_routing_bias,
                             {c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta}};
  std::vector<int32_t> routed_ids(n * K);
  std::vector<float> routed_weights(n * K);
  std::vector<int32_t> order;
  // The layer whose selections in host_blocks were queued to the device and not
  // waited for since (-1: none); each segment of a layer has its own rows there.
  int blocks_in_flight = -1;
  bool pending_routed = false;  // b.routed holds a MoE layer's routed experts not yet in h
  // One sequence (most passes): its keys, values and index keys go straight into its cache rows
  // (the projections write there, RoPE rotates them there); several: through the pass's buffers.
  const bool direct = segments.size() == 1;
  const size_t kv_width = Hkv * D;
  for (int l = 0; l < c.num_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    // The norm's input is the residual stream as the previous block left it: its check is that
    // block's (the embedding's for layer 0).
    // The previous MoE layer's routed experts join the residual stream here (pending_routed).
    const FiniteCheck previous{b.flag, l == 0 ? EmbeddingStage() : LayerStage(l - 1, kFeedForward)};
    dev.RmsNorm(b.h, pending_routed ? b.routed : nullptr, n, H, L.input_norm, c.rms_norm_eps, b.x, previous);
    pending_routed = false;
    const size_t first = segments[0].cache->length();
    float* keys = direct ? caches[0]->k[l] + first * kv_width : b.k;
    float* values = direct ? caches[0]->v[l] + first * kv_width : b.v;
    float* index_keys = direct && L.sparse ? caches[0]->ik[l] + first * Di : b.ik;
    // The projections of x, and the per-head norms and RoPE of q and k (and the indexer's: a NaN
    // there would change the choice of blocks, not the values, so it is checked apart).
    const Device::MatMulJob projections[] = {{&L.q, b.q, Hq * D, false},
                                             {&L.k, keys, kv_width, false},
                                             {&L.v, values, kv_width, false},
                                             {&L.index_q, b.iq, Hi * Di, false},
                                             {&L.index_k, index_keys, Di, false}};
    dev.MatMulMany(projections, L.sparse ? 5 : 3, b.x, n);
    const Device::NormRopeJob rotations[] = {{b.q, Hq, D, L.q_norm, {}},
                                             {keys, Hkv, D, L.k_norm, {}},
                                             {b.iq, Hi, Di, L.index_q_norm, {b.flag, LayerStage(l, kIndexQueries)}},
                                             {index_keys, 1, Di, L.index_k_norm, {b.flag, LayerStage(l, kIndexKeys)}}};
    dev.NormRope(rotations, L.sparse ? 4 : 2, n, c.rms_norm_eps, b.rope, c.rotary_dim);
    size_t row = 0;
    for (size_t i = 0; i < segments.size(); ++i) {
      const Model::Segment& s = segments[i];
      DeviceCache& dc = *caches[i];
      const size_t pos0 = s.cache->length();
      if (!direct) {
        dev.Copy(dc.k[l] + pos0 * kv_width, b.k + row * kv_width, s.n * kv_width * sizeof(float));
        dev.Copy(dc.v[l] + pos0 * kv_width, b.v + row * kv_width, s.n * kv_width * sizeof(float));
        if (L.sparse) dev.Copy(dc.ik[l] + pos0 * Di, b.ik + row * Di, s.n * Di * sizeof(float));
      }
      DeviceAttentionShape shape{c.num_heads, c.num_kv_heads, c.head_dim, 1, 1, 1};
      const int32_t* blocks = nullptr;
      const int32_t* counts = nullptr;
      if (L.sparse) {
        // Block scores on the device, the choice on the host (SelectBlocksForQuery); a query
        // that sees no more blocks than topk takes them all without scores.
        const double t0 = Now();
        BlockSelection selection;
        selection.Reset(s.n, static_cast<int>(Hi), static_cast<int>(topk));
        for (size_t q0 = 0; q0 < s.n; q0 += score_rows) {
          const size_t qn = std::min(score_rows, s.n - q0);
          const size_t blocks_seen = (pos0 + q0 + qn - 1) / B + 1;
          const bool scored = blocks_seen > topk;
          if (scored) {
            dev.IndexScores(b.iq + (row + q0) * Hi * Di, qn, static_cast<int64_t>(pos0 + q0), dc.ik[l], Hi, Di, B,
                            blocks_seen, b.scores);
            dev.ToHost(b.host_scores, b.scores, qn * Hi * blocks_seen * sizeof(float));
            end_stretch();
            M3_RETURN_IF_ERROR(dev.Wait());
            blocks_in_flight = -1;
          }
          for (size_t t = q0; t < q0 + qn; ++t)
            for (size_t h = 0; h < Hi; ++h)
              selection.counts[t * Hi + h] = SelectBlocksForQuery(
                  scored ? b.host_scores + ((t - q0) * Hi + h) * blocks_seen : nullptr, static_cast<int64_t>(pos0 + t),
                  sp, &selection.blocks[(t * Hi + h) * topk], &order);
        }
        if (observer) observer->OnBlockSelection(l, static_cast<int64_t>(pos0), selection);
        // The staging of an earlier layer's selection may still be on its way to the device
        // (no wait since: a layer with a dense MLP and no scores to read).
        if (blocks_in_flight >= 0 && blocks_in_flight != l) M3_RETURN_IF_ERROR(dev.Wait());
        blocks_in_flight = l;
        // The segment's blocks, then its counts, in one run of the staging: one copy.
        const size_t at = row * Hi * (topk + 1), counts_at = at + s.n * Hi * topk;
        std::copy(selection.blocks.begin(), selection.blocks.end(), b.host_blocks + at);
        std::copy(selection.counts.begin(), selection.counts.end(), b.host_blocks + counts_at);
        dev.ToDevice(b.blocks + at, b.host_blocks + at, s.n * Hi * (topk + 1) * sizeof(int32_t));
        blocks = b.blocks + at;
        counts = b.blocks + counts_at;
        shape.index_heads = static_cast<int>(Hi);
        shape.block_size = static_cast<int>(B);
        shape.topk = static_cast<int>(topk);
        selection_seconds += Now() - t0;
        segment_start = dev.Mark();
      }
      dev.Attention(shape, b.q + row * Hq * D, s.n, static_cast<int64_t>(pos0), dc.k[l], dc.v[l], blocks, counts,
                    b.core + row * Hq * D);
      row += s.n;
    }
    dev.MatMul(L.o, b.core, n, b.h, H, /*accumulate=*/true);
    dev.RmsNorm(b.h, nullptr, n, H, L.post_norm, c.rms_norm_eps, b.x, {b.flag, LayerStage(l, kAttention)});
    if (L.moe) {
      // Handoff: the normed rows and the router's logits to the host; the shared expert goes on
      // the device while the CPU runs the routed experts; their sum comes back.
      dev.MatMul(L.router, b.x, n, b.router, E, false);
      dev.ToHost(b.host_x, b.x, n * H * sizeof(float));
      dev.ToHost(b.host_router, b.router, n * E * sizeof(float));
      end_stretch();
      M3_RETURN_IF_ERROR(dev.Wait());
      blocks_in_flight = -1;
      const int shared_start = dev.Mark();
      if (L.mlp) {
        RunMlp(L, n);
      }
      shared.emplace_back(shared_start, dev.Mark());
      const double t_experts = Now();
      const MoeWeights& mw = weights.layers[static_cast<size_t>(l)].moe;
      for (size_t t = 0; t < n; ++t)
        RouteToken(b.host_router + t * E, mw.router_bias, moe_params, &routed_ids[t * K], &routed_weights[t * K]);
      if (observer) observer->OnRouting(l, positions[0], n, c.experts_per_token, routed_ids.data());
      MoeRoutedForward(tc, mw, moe_params, b.host_x, n, routed_ids.data(), routed_weights.data(), b.host_routed);
      experts_seconds += Now() - t_experts;
      dev.ToDevice(b.routed, b.host_routed, n * H * sizeof(float));
      segment_start = dev.Mark();  // once the experts' sum is on the device
      pending_routed = true;  // added by the next norm
    } else {
      RunMlp(L, n);
    }
    if (pending_routed && l == c.num_layers - 1) dev.Add(b.routed, n * H, b.h);
    if (l == c.num_layers - 1) dev.FlagNonFinite(b.h, n, H, LayerStage(l, kFeedForward), b.flag);  // no norm follows for every row
    if (observer) observer->OnLayerEnd(l, n);
  }

  // The rows that give logits, in order, then the final norm and lm_head.
  // The logits buffer holds kLogitChunk rows: a prompt's every row (perplexity) in parts.
  const size_t out_rows = logit_rows.size();
  for (size_t i = 0; i < out_rows; ++i) dev.Copy(b.x + i * H, b.h + logit_rows[i] * H, H * sizeof(float));
  dev.RmsNorm(b.x, nullptr, out_rows, H, final_norm_, c.rms_norm_eps, b.x, {});
  for (size_t r0 = 0; r0 < out_rows; r0 += b.logit_rows) {
    const size_t rn = std::min(b.logit_rows, out_rows - r0);
    dev.MatMul(lm_head_, b.x + r0 * H, rn, b.logits, V, false);
    // The stage numbers the chunk (its rows are the chunk's own).
    dev.FlagNonFinite(b.logits, rn, V, LayerStage(c.num_layers, 0) + static_cast<uint32_t>(r0 / b.logit_rows), b.flag);
    dev.ToHost(logits + r0 * V, b.logits, rn * V * sizeof(float));
    if (r0 + rn < out_rows) M3_RETURN_IF_ERROR(dev.Wait());  // the buffer is reused
  }
  dev.ToHost(b.host_flag, b.flag, sizeof(uint64_t));
  end_stretch();
  M3_RETURN_IF_ERROR(dev.Wait());
  double device_seconds = 0, shared_seconds = 0;
  for (const auto& [a, e] : busy) device_seconds += dev.Seconds(a, e);
  for (const auto& [a, e] : shared) shared_seconds += dev.Seconds(a, e);
  if (*b.host_flag != ~uint64_t{0}) {
    const uint32_t stage = static_cast<uint32_t>(*b.host_flag >> 40);
    const size_t r = static_cast<size_t>(*b.host_flag & ((uint64_t{1} << 40) - 1));
    std::string where;
    if (stage == EmbeddingStage()) {
      where = "the token embedding";
    } else if (stage >= LayerStage(c.num_layers, 0)) {
      where = "the final norm and lm_head";
    } else {
      const int layer = static_cast<int>((stage - 1) / kStagesPerLayer);
      const char* what[] = {"indexer queries", "indexer keys", "attention",
                            layers_[static_cast<size_t>(layer)].moe ? "MoE block" : "MLP"};
      where = Str("layer ", layer, "'s ", what[(stage - 1) % kStagesPerLayer]);
    }
    const uint32_t logits_stage = LayerStage(c.num_layers, 0);
    const int64_t pos = stage >= logits_stage ? positions[logit_rows[(stage - logits_stage) * b.logit_rows + r]]
                                              : positions[r];
    return Corrupt(where, " gave a non-finite value at position ", pos,
                   ": the model's weights are damaged or overflow fp32 (`m3 inspect --verify` finds a damaged tensor)");
  }
  for (const Model::Segment& s : segments) s.cache->SetLength(s.cache->length() + s.n);
  stats_.passes += 1;
  stats_.tokens += n;
  stats_.wall_seconds += Now() - t_start;
  stats_.device_seconds += device_seconds + shared_seconds;
  stats_.shared_seconds += shared_seconds;
  stats_.experts_seconds += experts_seconds;
  stats_.handoff_seconds += std::max(0.0, (Now() - t_start) - device_seconds - experts_seconds - selection_seconds);
  stats_.selection_seconds += selection_seconds;
  return Status::Ok();
}

}  // namespace m3
