#include "offload/dense_offload.h"

#include <algorithm>
#include <chrono>

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

// The device rows of `cache`, with room for `rows` positions.
StatusOr<DeviceCache*> EnsureDeviceCache(Device& device, const PassShape& shape, KvCache* cache, size_t rows) {
  auto* dc = dynamic_cast<DeviceCache*>(cache->attached().get());
  if (dc && dc->device != &device) dc = nullptr;
  if (!dc) {
    auto fresh = std::make_unique<DeviceCache>();
    fresh->device = &device;
    fresh->k.assign(cache->layers(), nullptr);
    fresh->v.assign(cache->layers(), nullptr);
    fresh->ik.assign(cache->layers(), nullptr);
    dc = fresh.get();
    cache->attached() = std::move(fresh);
  }
  if (rows <= dc->capacity) return dc;
  const size_t cap = (std::max({rows, dc->capacity + dc->capacity / 2, size_t{256}}) + 255) / 256 * 256;
  const size_t kv = shape.kv_heads * shape.head_dim;
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
    const size_t index_dim = cache->index_k(static_cast<int>(l)).dim();
    if (index_dim) M3_RETURN_IF_ERROR(grow(dc->ik[l], index_dim));
  }
  dc->capacity = cap;
  return dc;
}

}  // namespace

// The backend's buffers on the device and their host staging (pinned), grown as passes need.
struct DenseOffload::Buffers {
  Device* device = nullptr;
  size_t rows = 0, score_floats = 0, logit_rows = 0;
  float *k = nullptr, *v = nullptr, *ik = nullptr;  // several sequences' keys, before their caches
  float *g = nullptr, *u = nullptr, *routed = nullptr, *router = nullptr, *rope = nullptr, *rope_other = nullptr;
  float* scores = nullptr;
  int32_t* blocks = nullptr;  // per segment: its blocks [n][Hi][topk], then its counts [n][Hi]
  uint64_t* flag = nullptr;
  // Host side.
  float *host_h = nullptr, *host_x = nullptr, *host_router = nullptr, *host_routed = nullptr, *host_scores = nullptr;
  float *host_rope = nullptr, *host_rope_other = nullptr;
  int32_t* host_blocks = nullptr;
  uint64_t* host_flag = nullptr;
  std::vector<void*> device_owned, host_owned;
  float* logits = nullptr;  // logit_rows rows, grown apart (most passes need one row)
  std::vector<std::pair<float*, size_t>> slots;  // the model's activations: buffer, floats

  void FreeAll() {
    for (void* p : device_owned) device->Free(p);
    for (void* p : host_owned) device->FreeHost(p);
    device_owned.clear();
    host_owned.clear();
  }
  ~Buffers() {
    FreeAll();
    if (logits) device->Free(logits);
    for (auto& [p, n] : slots)
      if (p) device->Free(p);
  }
};

DenseOffload::DenseOffload(std::unique_ptr<Device> device, const PassShape& shape)
    : device_(std::move(device)), shape_(shape), buf_(std::make_unique<Buffers>()) {
  buf_->device = device_.get();
}

DenseOffload::~DenseOffload() {
  buf_.reset();
  for (void* p : owned_) device_->Free(p);
}

Status DenseOffload::Upload(const std::string& what, const simd::WeightRef& w) {
  if (!w.data) return Status::Ok();
  M3_ASSIGN_OR_RETURN(DeviceMatrix m, device_->Upload(w, what));
  owned_.push_back(m.codes);
  if (m.scales) owned_.push_back(m.scales);
  weight_bytes_ += m.bytes();
  matrices_[&w] = m;
  return Status::Ok();
}

Status DenseOffload::Upload(const std::string& what, const std::vector<float>& v) {
  if (v.empty()) return Status::Ok();
  M3_ASSIGN_OR_RETURN(void* p, device_->Allocate(v.size() * sizeof(float), what));
  owned_.push_back(p);
  device_->ToDevice(p, v.data(), v.size() * sizeof(float));
  vectors_[&v] = static_cast<float*>(p);
  weight_bytes_ += v.size() * sizeof(float);
  return device_->Wait();  // v is the caller's: copied before it can change
}

const float* DenseOffload::vector(const std::vector<float>& v) const {
  return v.empty() ? nullptr : vectors_.at(&v);
}

Status DenseOffload::EnsureBuffers(size_t rows, size_t score_floats) {
  Buffers& b = *buf_;
  if (rows <= b.rows && score_floats <= b.score_floats) return Status::Ok();
  M3_RETURN_IF_ERROR(device_->Wait());  // nothing queued still uses the old ones
  b.FreeAll();
  rows = std::max(rows, b.rows);
  score_floats = std::max(score_floats, b.score_floats);
  const PassShape& s = shape_;
  const size_t H = s.hidden, Hkv = s.kv_heads, D = s.head_dim;
  const size_t Hi = s.any_sparse ? static_cast<size_t>(s.sparse.num_index_heads) : 0;
  const size_t Di = s.any_sparse ? static_cast<size_t>(s.sparse.index_dim) : 0;
  const size_t topk = s.any_sparse ? static_cast<size_t>(s.sparse.topk_blocks) : 0;
  const size_t inter = s.max_intermediate, E = s.experts, half = static_cast<size_t>(s.rope->rotary_dim()) / 2;
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
  M3_RETURN_IF_ERROR(dev(&b.k, rows * Hkv * D, "keys"));
  M3_RETURN_IF_ERROR(dev(&b.v, rows * Hkv * D, "values"));
  M3_RETURN_IF_ERROR(dev(&b.ik, rows * Di, "index keys"));
  M3_RETURN_IF_ERROR(dev(&b.g, rows * inter, "gate"));
  M3_RETURN_IF_ERROR(dev(&b.u, rows * inter, "up"));
  M3_RETURN_IF_ERROR(dev(&b.routed, rows * H, "routed experts"));
  M3_RETURN_IF_ERROR(dev(&b.router, rows * E, "router logits"));
  M3_RETURN_IF_ERROR(dev(&b.rope, rows * half * 2, "rope"));
  M3_RETURN_IF_ERROR(dev(&b.rope_other, rows * half * 2, "rope"));
  M3_RETURN_IF_ERROR(dev(&b.scores, score_floats, "block scores"));
  M3_RETURN_IF_ERROR(dev(&b.blocks, rows * Hi * (topk + 1), "selected blocks"));
  M3_RETURN_IF_ERROR(dev(&b.flag, 1, "flag"));
  M3_RETURN_IF_ERROR(host(&b.host_h, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_x, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_router, rows * E));
  M3_RETURN_IF_ERROR(host(&b.host_routed, rows * H));
  M3_RETURN_IF_ERROR(host(&b.host_scores, score_floats));
  M3_RETURN_IF_ERROR(host(&b.host_rope, rows * half * 2));
  M3_RETURN_IF_ERROR(host(&b.host_rope_other, rows * half * 2));
  M3_RETURN_IF_ERROR(host(&b.host_blocks, rows * Hi * (topk + 1)));
  M3_RETURN_IF_ERROR(host(&b.host_flag, 1));
  b.rows = rows;
  b.score_floats = score_floats;
  return Status::Ok();
}

StatusOr<float*> DenseOffload::Slot(size_t slot, size_t floats) {
  auto& slots = buf_->slots;
  if (slots.size() <= slot) slots.resize(slot + 1, {nullptr, 0});
  auto& [p, size] = slots[slot];
  if (floats > size || !p) {
    M3_RETURN_IF_ERROR(device_->Wait());  // nothing queued still uses the old one
    if (p) device_->Free(p);
    p = nullptr;
    size = 0;
    M3_ASSIGN_OR_RETURN(void* a, device_->Allocate(std::max<size_t>(floats, 1) * sizeof(float), "activations"));
    p = static_cast<float*>(a);
    size = std::max<size_t>(floats, 1);
  }
  return p;
}

// One pass on the device. Steps are queued on the device's stream and return at once; the host
// waits where it needs a result (block scores, the MoE handoff, the logits) and at Finish.
class DenseOffload::Pass final : public BackendPass {
 public:
  Pass(DenseOffload& o, const OpContext& tc) : o_(o), dev_(*o.device_), b_(*o.buf_), s_(o.shape_), tc_(tc) {}

  Status Begin(std::span<const PassSegment> segments);

  StatusOr<float*> Floats(size_t slot, size_t floats) override { return o_.Slot(slot, floats); }
  Status Embed(const simd::WeightRef& table, const int32_t* ids, size_t n, float* h, CheckSite check) override;
  Status CheckFinite(const float* x, size_t rows, size_t width, CheckSite check) override;
  void Norm(const float* x, size_t rows, const std::vector<float>& scale, float* y) override;
  void GatherRows(const float* src, size_t width, std::span<const size_t> rows, float* dst) override;
  void Project(const float* x, size_t n, std::span<const MatMulTarget> targets) override;
  Status NormRope(std::span<const NormRopeJob> jobs, size_t n, const int64_t* positions) override;
  StatusOr<KeyValueRows> KeyValueTargets(int layer, bool sparse) override;
  void StoreKeyValues(int layer, const KeyValueRows& rows) override;
  Status SelectBlocks(int layer, size_t segment, const float* iq, int64_t pos0, size_t n,
                      BlockSelection* out) override;
  void Attention(int layer, size_t segment, const float* q, int64_t pos0, size_t n, const BlockSelection* selection,
                 float* out) override;
  void AddMatMul(const simd::WeightRef& w, const float* x, size_t n, float* h) override;
  void AddMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h) override;
  Status AddMoe(int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* h,
                int32_t* routed_ids) override;
  Status Logits(const simd::WeightRef& lm_head, const float* x, size_t rows, float* logits,
                CheckSite check) override;
  Status Finish() override;

 private:
  // A check queued for the values at x (rows of width), not yet run: the next norm of x runs it
  // as it reads them; any other step first runs it on its own.
  struct PendingCheck {
    const float* x = nullptr;
    size_t rows = 0, width = 0;
    uint32_t stage = 0;
  };
  // The stage of a check: its index in pass order, which the flag keeps (the first failure is
  // the smallest stage << 40 | row).
  uint32_t Stage(const CheckSite& site) {
    stages_.push_back(site);
    return static_cast<uint32_t>(stages_.size() - 1);
  }
  // Runs what waits for the next norm: the routed experts' sum into the residual stream, then
  // the check.
  void Settle() {
    if (routed_into_) dev_.Add(b_.routed, routed_rows_ * s_.hidden, routed_into_);
    routed_into_ = nullptr;
    if (pending_.x) dev_.FlagNonFinite(pending_.x, pending_.rows, pending_.width, pending_.stage, b_.flag);
    pending_ = {};
  }
  void EndStretch() {
    if (stretch_open_) busy_.emplace_back(stretch_start_, dev_.Mark());
    stretch_open_ = false;
  }
  void StartStretch() {
    if (!stretch_open_) stretch_start_ = dev_.Mark();
    stretch_open_ = true;
  }
  Status Wait() {
    EndStretch();
    M3_RETURN_IF_ERROR(dev_.Wait());
    blocks_in_flight_ = -1;
    return Status::Ok();
  }
  // Device cos/sin of n rows at `positions`: the pass's own (uploaded at its start) or others'.
  Status Rotations(size_t n, const int64_t* positions, const float** rope);
  // A dense MLP, or a MoE layer's shared expert, of x into h (added).
  void RunMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h);

  DenseOffload& o_;
  Device& dev_;
  Buffers& b_;
  const PassShape& s_;
  const OpContext tc_;
  std::unique_lock<std::mutex> lock_{o_.pass_};
  double t_start_ = Now();
  std::vector<PassSegment> segments_;
  std::vector<DeviceCache*> caches_;
  std::vector<size_t> first_row_;  // each segment's first row of the pass
  std::vector<int64_t> positions_;
  size_t rows_ = 0, score_rows_ = 0;
  bool rope_other_used_ = false;
  std::vector<CheckSite> stages_;
  PendingCheck pending_;
  float* routed_into_ = nullptr;  // b.routed holds a MoE block's routed experts not yet added here
  size_t routed_rows_ = 0;
  // The layer whose selections in host_blocks were queued to the device and not waited for
  // since (-1: none); each segment of a layer has its own rows there.
  int blocks_in_flight_ = -1;
  std::vector<int32_t> order_, routed_ids_;
  std::vector<float> routed_weights_;
  // The device's busy time: marks around each stretch of queued work (a stretch ends where the
  // host waits for its result and the next begins once the host has queued more), read at the end.
  std::vector<std::pair<int, int>> busy_, shared_;
  int stretch_start_ = 0;
  bool stretch_open_ = false;
  double experts_seconds_ = 0, selection_seconds_ = 0;
  Status failed_;  // a failure of a step that returns nothing, for Finish
};

Status DenseOffload::Pass::Begin(std::span<const PassSegment> segments) {
  for (const PassSegment& s : segments) {
    if (s.cache->options().kv != CacheType::kF32 || s.cache->options().index_keys != CacheType::kF32)
      return Unsupported("the offloaded dense part keeps its caches in f32 on the device: a session with ",
                         CacheTypeName(s.cache->options().kv), " K/V or ", CacheTypeName(s.cache->options().index_keys),
                         " index keys cannot run on it");
    segments_.push_back(s);
    first_row_.push_back(rows_);
    rows_ += s.n;
    for (size_t t = 0; t < s.n; ++t) positions_.push_back(static_cast<int64_t>(s.cache->length() + t));
  }
  // Block scores of at most 16M floats at a time (queries of a long prompt in parts).
  const size_t B = static_cast<size_t>(s_.sparse.block_size);
  const size_t Hi = s_.any_sparse ? static_cast<size_t>(s_.sparse.num_index_heads) : 0;
  size_t max_blocks = 1;
  for (const int64_t p : positions_) max_blocks = std::max(max_blocks, static_cast<size_t>(p) / B + 1);
  score_rows_ = Hi ? std::max<size_t>(1, std::min(rows_, (size_t{1} << 24) / (Hi * max_blocks))) : 0;
  M3_RETURN_IF_ERROR(o_.EnsureBuffers(rows_, score_rows_ * Hi * max_blocks));
  for (const PassSegment& s : segments_) {
    M3_ASSIGN_OR_RETURN(DeviceCache * dc, EnsureDeviceCache(dev_, s_, s.cache, s.cache->length() + s.n));
    caches_.push_back(dc);
  }
  dev_.ResetMarks();
  StartStretch();
  const size_t half = static_cast<size_t>(s_.rope->rotary_dim()) / 2;
  for (size_t t = 0; t < rows_; ++t) s_.rope->CosSin(positions_[t], b_.host_rope + t * half * 2);
  *b_.host_flag = ~uint64_t{0};
  dev_.ToDevice(b_.rope, b_.host_rope, rows_ * half * 2 * sizeof(float));
  dev_.ToDevice(b_.flag, b_.host_flag, sizeof(uint64_t));
  return Status::Ok();
}

Status DenseOffload::Pass::Embed(const simd::WeightRef& table, const int32_t* ids, size_t n, float* h,
                                 CheckSite check) {
  // Exact, on the host: a token reads one row of the table.
  m3::GatherRows(table, ids, n, b_.host_h);
  dev_.ToDevice(h, b_.host_h, n * s_.hidden * sizeof(float));
  return CheckFinite(h, n, s_.hidden, check);
}

Status DenseOffload::Pass::CheckFinite(const float* x, size_t rows, size_t width, CheckSite check) {
  if (!check.what) return Status::Ok();
  if (pending_.x) Settle();
  pending_ = {x, rows, width, Stage(check)};
  return Status::Ok();
}

void DenseOffload::Pass::Norm(const float* x, size_t rows, const std::vector<float>& scale, float* y) {
  // The norm's input is the residual stream as the previous block left it: the routed experts'
  // sum joins it here, and its check is folded in.
  bool add = routed_into_ == x && routed_rows_ == rows;
  bool check = pending_.x == x && pending_.rows == rows && pending_.width == s_.hidden;
  if ((routed_into_ && !add) || (pending_.x && !check)) {
    Settle();
    add = check = false;
  }
  const m3::FiniteCheck fold = check ? m3::FiniteCheck{b_.flag, pending_.stage} : m3::FiniteCheck{};
  if (add) {
    dev_.RmsNorm(routed_into_, b_.routed, rows, s_.hidden, o_.vector(scale), s_.eps, y, fold);
  } else {
    // Read only: the device's norm writes x only where it adds to it.
    dev_.RmsNorm(const_cast<float*>(x), nullptr, rows, s_.hidden, o_.vector(scale), s_.eps, y, fold);
  }
  routed_into_ = nullptr;
  pending_ = {};
}

void DenseOffload::Pass::GatherRows(const float* src, size_t width, std::span<const size_t> rows, float* dst) {
  Settle();
  for (size_t i = 0; i < rows.size(); ++i)
    if (dst + i * width != src + rows[i] * width) dev_.Copy(dst + i * width, src + rows[i] * width, width * sizeof(float));
}

void DenseOffload::Pass::Project(const float* x, size_t n, std::span<const MatMulTarget> targets) {
  Settle();
  Device::MatMulJob jobs[8];
  for (size_t i = 0; i < targets.size(); ++i) jobs[i] = {&o_.matrix(*targets[i].w), targets[i].y, targets[i].ldy, false};
  dev_.MatMulMany(jobs, targets.size(), x, n);
}

Status DenseOffload::Pass::Rotations(size_t n, const int64_t* positions, const float** rope) {
  if (n <= rows_ && std::equal(positions, positions + n, positions_.begin())) {
    *rope = b_.rope;
    return Status::Ok();
  }
  if (rope_other_used_) M3_RETURN_IF_ERROR(Wait());  // its staging may still be on its way
  const size_t half = static_cast<size_t>(s_.rope->rotary_dim()) / 2;
  for (size_t t = 0; t < n; ++t) s_.rope->CosSin(positions[t], b_.host_rope_other + t * half * 2);
  dev_.ToDevice(b_.rope_other, b_.host_rope_other, n * half * 2 * sizeof(float));
  rope_other_used_ = true;
  *rope = b_.rope_other;
  return Status::Ok();
}

Status DenseOffload::Pass::NormRope(std::span<const NormRopeJob> jobs, size_t n, const int64_t* positions) {
  if (n == 0) return Status::Ok();
  Settle();
  const float* rope = nullptr;
  M3_RETURN_IF_ERROR(Rotations(n, positions, &rope));
  Device::NormRopeJob device_jobs[4];
  for (size_t i = 0; i < jobs.size(); ++i) {
    const NormRopeJob& j = jobs[i];
    const m3::FiniteCheck check = j.check.what ? m3::FiniteCheck{b_.flag, Stage(j.check)} : m3::FiniteCheck{};
    device_jobs[i] = {j.x, j.heads, j.dim, j.norm ? o_.vector(*j.norm) : nullptr, check};
  }
  dev_.NormRope(device_jobs, jobs.size(), n, s_.eps, rope, static_cast<size_t>(s_.rope->rotary_dim()));
  return Status::Ok();
}

StatusOr<KeyValueRows> DenseOffload::Pass::KeyValueTargets(int layer, bool sparse) {
  // One sequence (most passes): its keys, values and index keys go straight into its cache rows
  // (the projections write there, RoPE rotates them there); several: through the pass's buffers.
  if (segments_.size() > 1) return KeyValueRows{b_.k, b_.v, sparse ? b_.ik : nullptr};
  const size_t first = segments_[0].cache->length(), kv = s_.kv_heads * s_.head_dim;
  const DeviceCache& dc = *caches_[0];
  const size_t l = static_cast<size_t>(layer);
  return KeyValueRows{dc.k[l] + first * kv, dc.v[l] + first * kv,
                      sparse ? dc.ik[l] + first * static_cast<size_t>(s_.sparse.index_dim) : nullptr};
}

void DenseOffload::Pass::StoreKeyValues(int layer, const KeyValueRows& kv) {
  if (segments_.size() == 1) return;  // written in place
  const size_t width = s_.kv_heads * s_.head_dim, Di = static_cast<size_t>(s_.sparse.index_dim);
  const size_t l = static_cast<size_t>(layer);
  for (size_t i = 0; i < segments_.size(); ++i) {
    const size_t pos0 = segments_[i].cache->length(), row = first_row_[i], n = segments_[i].n;
    DeviceCache& dc = *caches_[i];
    dev_.Copy(dc.k[l] + pos0 * width, kv.k + row * width, n * width * sizeof(float));
    dev_.Copy(dc.v[l] + pos0 * width, kv.v + row * width, n * width * sizeof(float));
    if (kv.index_k) dev_.Copy(dc.ik[l] + pos0 * Di, kv.index_k + row * Di, n * Di * sizeof(float));
  }
}

Status DenseOffload::Pass::SelectBlocks(int layer, size_t segment, const float* iq, int64_t pos0, size_t n,
                                        BlockSelection* out) {
  // Block scores on the device, the choice on the host (SelectBlocksForQuery); a query that sees
  // no more blocks than topk takes them all without scores.
  Settle();
  const double t0 = Now();
  const SparseParams& sp = s_.sparse;
  const size_t Hi = static_cast<size_t>(sp.num_index_heads), Di = static_cast<size_t>(sp.index_dim);
  const size_t B = static_cast<size_t>(sp.block_size), topk = static_cast<size_t>(sp.topk_blocks);
  const float* keys = caches_[segment]->ik[static_cast<size_t>(layer)];
  out->Reset(n, static_cast<int>(Hi), static_cast<int>(topk));
  for (size_t q0 = 0; q0 < n; q0 += score_rows_) {
    const size_t qn = std::min(score_rows_, n - q0);
    const size_t first = static_cast<size_t>(pos0) + q0;
    const size_t blocks_seen = (first + qn - 1) / B + 1;
    const bool scored = blocks_seen > topk;
    if (scored) {
      dev_.IndexScores(iq + q0 * Hi * Di, qn, static_cast<int64_t>(first), keys, Hi, Di, B, blocks_seen, b_.scores);
      dev_.ToHost(b_.host_scores, b_.scores, qn * Hi * blocks_seen * sizeof(float));
      M3_RETURN_IF_ERROR(Wait());
    }
    for (size_t t = q0; t < q0 + qn; ++t)
      for (size_t h = 0; h < Hi; ++h)
        out->counts[t * Hi + h] = SelectBlocksForQuery(
            scored ? b_.host_scores + ((t - q0) * Hi + h) * blocks_seen : nullptr, pos0 + static_cast<int64_t>(t), sp,
            &out->blocks[(t * Hi + h) * topk], &order_);
  }
  selection_seconds_ += Now() - t0;
  return Status::Ok();
}

void DenseOffload::Pass::Attention(int layer, size_t segment, const float* q, int64_t pos0, size_t n,
                                   const BlockSelection* selection, float* out) {
  Settle();
  DeviceAttentionShape shape{static_cast<int>(s_.heads), static_cast<int>(s_.kv_heads), static_cast<int>(s_.head_dim),
                             1, 1, 1};
  const int32_t* blocks = nullptr;
  const int32_t* counts = nullptr;
  if (selection) {
    const SparseParams& sp = s_.sparse;
    const size_t Hi = static_cast<size_t>(sp.num_index_heads), topk = static_cast<size_t>(sp.topk_blocks);
    // The staging of an earlier layer's selection may still be on its way to the device (no
    // wait since: a layer with a dense MLP and no scores to read).
    if (blocks_in_flight_ >= 0 && blocks_in_flight_ != layer) {
      EndStretch();
      if (Status st = dev_.Wait(); !st.ok() && failed_.ok()) failed_ = st;  // reported by Finish
    }
    blocks_in_flight_ = layer;
    // The segment's blocks, then its counts, in one run of the staging: one copy.
    const size_t at = first_row_[segment] * Hi * (topk + 1), counts_at = at + n * Hi * topk;
    std::copy(selection->blocks.begin(), selection->blocks.end(), b_.host_blocks + at);
    std::copy(selection->counts.begin(), selection->counts.end(), b_.host_blocks + counts_at);
    dev_.ToDevice(b_.blocks + at, b_.host_blocks + at, n * Hi * (topk + 1) * sizeof(int32_t));
    blocks = b_.blocks + at;
    counts = b_.blocks + counts_at;
    shape.index_heads = sp.num_index_heads;
    shape.block_size = sp.block_size;
    shape.topk = sp.topk_blocks;
  }
  StartStretch();
  const DeviceCache& dc = *caches_[segment];
  const size_t l = static_cast<size_t>(layer);
  dev_.Attention(shape, q, n, pos0, dc.k[l], dc.v[l], blocks, counts, out);
}

void DenseOffload::Pass::AddMatMul(const simd::WeightRef& w, const float* x, size_t n, float* h) {
  Settle();
  dev_.MatMul(o_.matrix(w), x, n, h, s_.hidden, /*accumulate=*/true);
}

void DenseOffload::Pass::RunMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h) {
  const DeviceMatrix& gate = o_.matrix(w.gate);
  const size_t inter = gate.layout.rows;
  const Device::MatMulJob gate_up[] = {{&gate, b_.g, inter, false}, {&o_.matrix(w.up), b_.u, inter, false}};
  dev_.MatMulMany(gate_up, 2, x, n);
  dev_.Swiglu(b_.g, b_.u, n * inter, DeviceSwiglu{act.alpha, act.limit, act.beta});
  dev_.MatMul(o_.matrix(w.down), b_.g, n, h, s_.hidden, /*accumulate=*/true);
}

void DenseOffload::Pass::AddMlp(const MlpWeights& w, const SwigluParams& act, const float* x, size_t n, float* h) {
  Settle();
  RunMlp(w, act, x, n, h);
}

Status DenseOffload::Pass::AddMoe(int, const MoeWeights& w, const MoeParams& p, const float* x, size_t n, float* h,
                                  int32_t* routed_ids) {
  // Handoff: the normed rows and the router's logits to the host; the shared expert goes on the
  // device while the CPU runs the routed experts; their sum comes back.
  Settle();
  const size_t H = s_.hidden, E = s_.experts, K = static_cast<size_t>(p.top_k);
  dev_.MatMul(o_.matrix(w.router), x, n, b_.router, E, false);
  dev_.ToHost(b_.host_x, x, n * H * sizeof(float));
  dev_.ToHost(b_.host_router, b_.router, n * E * sizeof(float));
  M3_RETURN_IF_ERROR(Wait());
  const int shared_start = dev_.Mark();
  if (w.has_shared) RunMlp(w.shared, p.act, x, n, h);
  shared_.emplace_back(shared_start, dev_.Mark());
  const double t_experts = Now();
  routed_weights_.resize(n * K);
  for (size_t t = 0; t < n; ++t)
    RouteToken(b_.host_router + t * E, w.router_bias, p, &routed_ids[t * K], &routed_weights_[t * K]);
  MoeRoutedForward(tc_, w, p, b_.host_x, n, routed_ids, routed_weights_.data(), b_.host_routed);
  experts_seconds_ += Now() - t_experts;
  dev_.ToDevice(b_.routed, b_.host_routed, n * H * sizeof(float));
  StartStretch();  // once the experts' sum is on its way
  routed_into_ = h;  // added by the next norm
  routed_rows_ = n;
  return Status::Ok();
}

Status DenseOffload::Pass::Logits(const simd::WeightRef& lm_head, const float* x, size_t rows, float* logits,
                                  CheckSite check) {
  // The logits buffer holds kLogitChunk rows: a prompt's every row (perplexity) in parts.
  constexpr size_t kLogitChunk = 256;
  Settle();
  const size_t V = s_.vocab, chunk = std::min(rows, kLogitChunk);
  if (b_.logit_rows < chunk) {
    M3_RETURN_IF_ERROR(Wait());  // nothing queued still uses the old one
    if (b_.logits) dev_.Free(b_.logits);
    b_.logits = nullptr;
    b_.logit_rows = 0;
    M3_ASSIGN_OR_RETURN(void* a, dev_.Allocate(chunk * V * sizeof(float), "activations (logits)"));
    b_.logits = static_cast<float*>(a);
    b_.logit_rows = chunk;
  }
  for (size_t r0 = 0; r0 < rows; r0 += chunk) {
    const size_t rn = std::min(chunk, rows - r0);
    StartStretch();
    dev_.MatMul(o_.matrix(lm_head), x + r0 * s_.hidden, rn, b_.logits, V, false);
    CheckSite part = check;
    part.positions = check.positions + r0;  // the chunk's rows are its own
    if (check.what) dev_.FlagNonFinite(b_.logits, rn, V, Stage(part), b_.flag);
    dev_.ToHost(logits + r0 * V, b_.logits, rn * V * sizeof(float));
    if (r0 + rn < rows) M3_RETURN_IF_ERROR(Wait());  // the buffer is reused
  }
  return Status::Ok();
}

Status DenseOffload::Pass::Finish() {
  M3_RETURN_IF_ERROR(failed_);
  Settle();
  dev_.ToHost(b_.host_flag, b_.flag, sizeof(uint64_t));
  M3_RETURN_IF_ERROR(Wait());
  double device_seconds = 0, shared_seconds = 0;
  for (const auto& [a, e] : busy_) device_seconds += dev_.Seconds(a, e);
  for (const auto& [a, e] : shared_) shared_seconds += dev_.Seconds(a, e);
  if (*b_.host_flag != ~uint64_t{0}) {
    const size_t stage = static_cast<size_t>(*b_.host_flag >> 40);
    const size_t row = static_cast<size_t>(*b_.host_flag & ((uint64_t{1} << 40) - 1));
    const CheckSite& at = stages_.at(stage);
    return NonFiniteError(at, at.positions[row], nullptr);
  }
  OffloadStats& st = o_.stats_;
  const double wall = Now() - t_start_;
  st.passes += 1;
  st.tokens += rows_;
  st.wall_seconds += wall;
  st.device_seconds += device_seconds + shared_seconds;
  st.shared_seconds += shared_seconds;
  st.experts_seconds += experts_seconds_;
  st.handoff_seconds += std::max(0.0, wall - device_seconds - experts_seconds_ - selection_seconds_);
  st.selection_seconds += selection_seconds_;
  return Status::Ok();
}

StatusOr<std::unique_ptr<BackendPass>> DenseOffload::BeginPass(const OpContext& tc,
                                                               std::span<const PassSegment> segments) {
  auto pass = std::make_unique<Pass>(*this, tc);
  M3_RETURN_IF_ERROR(pass->Begin(segments));
  return std::unique_ptr<BackendPass>(std::move(pass));
}

}  // namespace m3
