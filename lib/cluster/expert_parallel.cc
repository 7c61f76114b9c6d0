#include "cluster/expert_parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/hash.h"
#include "cluster/mpi_group.h"
#include "ops/workspace.h"
#include "platform/parallel.h"

namespace m3::cluster {
namespace {

// What rank 0 tells the followers, broadcast before each step's data.
enum Op : int32_t { kOpen = 1, kMoe = 2, kProbe = 3, kClose = 4, kExit = 5, kReadIn = 6 };
struct Header {
  int32_t op = 0;
  int32_t layer = 0;  // kMoe: the layer (Model::MoeOfLayer); kProbe: repeats
  uint64_t n = 0;     // kMoe, kProbe: rows; kOpen: bytes of the options
  int32_t split = 0;  // kProbe: the exchanges of a MoeSplitKind
  int32_t unused = 0;
};

void Broadcast(MPI_Comm comm, Header* h) { MPI_Bcast(h, sizeof(Header), MPI_BYTE, 0, comm); }

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Displacements of counts (in elements), as ints for MPI.
StatusOr<std::vector<int>> Ints(std::span<const size_t> counts, const char* what) {
  std::vector<int> out;
  size_t total = 0;
  for (size_t c : counts) {
    M3_ASSIGN_OR_RETURN(const int v, MpiCount(c, what));
    out.push_back(v);
    total += c;
  }
  M3_RETURN_IF_ERROR(MpiCount(total, what).status());
  return out;
}

std::vector<int> Displacements(const std::vector<int>& counts) {
  std::vector<int> d(counts.size(), 0);
  for (size_t i = 1; i < counts.size(); ++i) d[i] = d[i - 1] + counts[i - 1];
  return d;
}

// The exchanges of a MoePart over MPI, timed and counted into `stats` (rank 0's).
class MpiExchange : public MoeExchange {
 public:
  MpiExchange(MPI_Comm comm, int rank, int size, ExchangeStats* stats)
      : comm_(comm), rank_(rank), size_(size), stats_(stats) {}
  Status AllGather(const float* own, std::span<const size_t> counts, float* all) override {
    M3_ASSIGN_OR_RETURN(const std::vector<int> c, Ints(counts, "the MoE activation exchange"));
    const std::vector<int> d = Displacements(c);
    const double t0 = Now();
    MPI_Allgatherv(own, c[static_cast<size_t>(rank_)], MPI_FLOAT, all, c.data(), d.data(), MPI_FLOAT, comm_);
    if (stats_) {
      stats_->activations_s += Now() - t0;
      for (int v : c) stats_->bytes += static_cast<uint64_t>(v) * sizeof(float) * static_cast<uint64_t>(size_ - 1);
    }
    return Status::Ok();
  }
  Status Gather(const float* own, std::span<const size_t> counts, float* all) override {
    M3_ASSIGN_OR_RETURN(const std::vector<int> c, Ints(counts, "the MoE output exchange"));
    const std::vector<int> d = Displacements(c);
    const double t0 = Now();
    MPI_Gatherv(own, c[static_cast<size_t>(rank_)], MPI_FLOAT, all, c.data(), d.data(), MPI_FLOAT, 0, comm_);
    if (stats_) {
      stats_->outputs_s += Now() - t0;
      for (size_t q = 1; q < c.size(); ++q) stats_->bytes += static_cast<uint64_t>(c[q]) * sizeof(float);
    }
    return Status::Ok();
  }

 private:
  MPI_Comm comm_;
  int rank_, size_;
  ExchangeStats* stats_;
};

// A block's input rows and routes, as one broadcast: x [n, H] floats, ids [n, k], weights [n, k].
struct Payload {
  std::vector<uint8_t> bytes;
  size_t x_bytes = 0, ids_bytes = 0;
  Payload(size_t n, size_t hidden, size_t k)
      : bytes(n * hidden * sizeof(float) + n * k * (sizeof(int32_t) + sizeof(float))),
        x_bytes(n * hidden * sizeof(float)),
        ids_bytes(n * k * sizeof(int32_t)) {}
  float* x() { return reinterpret_cast<float*>(bytes.data()); }
  int32_t* ids() { return reinterpret_cast<int32_t*>(bytes.data() + x_bytes); }
  float* weights() { return reinterpret_cast<float*>(bytes.data() + x_bytes + ids_bytes); }
};

Status BroadcastBytes(MPI_Comm comm, uint8_t* data, size_t bytes) {
  M3_ASSIGN_OR_RETURN(const int count, MpiCount(bytes, "a MoE block's input rows"));
  MPI_Bcast(data, count, MPI_BYTE, 0, comm);
  return Status::Ok();
}

// What identifies a model across ranks: its shapes and formats (every rank must open the same).
// Each rank holds its own rows of the experts, so their matrices count by what a slice keeps: format,
// columns and group (the whole rows are the other matrix's columns: gate and up [I, H], down [H, I]).
std::string Fingerprint(const Model& m) {
  const ModelConfig& c = m.config();
  std::string s = Str(c.num_layers, "/", c.hidden_size, "/", c.vocab_size, "/", c.num_experts, "/",
                      c.experts_per_token);
  auto add = [&](const simd::WeightRef& w, bool whole) {
    s += Str("|", static_cast<int>(w.format), ":", whole ? w.rows : 0, "x", w.cols, "g", w.group);
  };
  for (int l = 0; m.MoeOfLayer(l) || l < c.num_layers; ++l) {
    const MoeWeights* moe = m.MoeOfLayer(l);
    if (!moe) continue;
    add(moe->router, true);
    for (const MlpWeights& e : moe->experts) add(e.gate, false), add(e.up, false), add(e.down, false);
    if (moe->has_shared) add(moe->shared.gate, false), add(moe->shared.down, false);
  }
  return Str(c.num_layers, "L ", c.hidden_size, "H ", Hash64(s.data(), s.size()));
}

MoeParams ParamsOf(const ModelConfig& c) {
  return {c.experts_per_token, c.routed_scaling_factor, c.use_routing_bias,
          {c.swiglu_alpha, c.swiglu_limit, c.swiglu_beta}};
}

}  // namespace

namespace {

// Shapes of the exchanges of a decode-like block (each row to top-k distinct experts).
struct BlockShape {
  size_t hidden = 0, k = 0, inter = 0, shared_inter = 0;
  static size_t Cols(size_t width, const MoePart& part) {
    const auto [c0, c1] = PartColumns(width, part);
    return c1 - c0;
  }
  std::vector<size_t> activation_counts(size_t n, int size) const {
    std::vector<size_t> c;
    for (int q = 0; q < size; ++q) c.push_back(n * (k * Cols(inter, {q, size}) + Cols(shared_inter, {q, size})));
    return c;
  }
  std::vector<size_t> output_counts(size_t n, int size) const {
    std::vector<size_t> c;
    for (int q = 0; q < size; ++q) c.push_back(n * Cols(hidden, {q, size}));
    return c;
  }
};

StatusOr<BlockShape> ShapeOf(const Model& m) {
  for (int l = 0; l < m.config().num_layers; ++l)
    if (const MoeWeights* w = m.MoeOfLayer(l)) {
      BlockShape s;
      s.hidden = static_cast<size_t>(m.config().hidden_size);
      s.k = static_cast<size_t>(m.config().experts_per_token);
      s.inter = w->experts.empty() ? 0 : w->experts[0].down.cols;
      s.shared_inter = w->has_shared ? w->shared.down.cols : 0;
      return s;
    }
  return InvalidArgument("the model has no MoE layer to exchange");
}

// The exchanges of `repeats` blocks of n rows with nothing computed (every rank). Whole experts
// per rank: no activations move, and each rank's expert outputs (whole rows, k per token shared
// evenly, as uniform routing gives on average) go to rank 0, which sums them in slot order.
void RunProbe(MPI_Comm comm, int rank, int size, const BlockShape& shape, size_t n, int repeats, MoeSplitKind split,
              ExchangeStats* stats) {
  Payload payload(n, shape.hidden, shape.k);
  std::vector<size_t> act = shape.activation_counts(n, size), outs = shape.output_counts(n, size);
  if (split == MoeSplitKind::kWholeExperts) {
    for (int q = 0; q < size; ++q) {
      const size_t rows = n * shape.k * static_cast<size_t>(q + 1) / static_cast<size_t>(size) -
                          n * shape.k * static_cast<size_t>(q) / static_cast<size_t>(size);
      outs[static_cast<size_t>(q)] = rows * shape.hidden;
    }
  }
  size_t act_total = 0, out_total = 0;
  for (size_t c : act) act_total += c;
  for (size_t c : outs) out_total += c;
  std::vector<float> own(std::max(act[static_cast<size_t>(rank)], outs[static_cast<size_t>(rank)]) + 1),
      all(std::max(act_total, out_total) + 1);
  MpiExchange ex(comm, rank, size, stats);
  for (int r = 0; r < repeats; ++r) {
    (void)BroadcastBytes(comm, payload.bytes.data(), payload.bytes.size());
    if (split == MoeSplitKind::kSlices) (void)ex.AllGather(own.data(), act, all.data());
    (void)ex.Gather(own.data(), outs, all.data());
  }
}

// A follower's part of one model, and what computing its slices needs.
struct Part {
  std::unique_ptr<FollowerPart> opened;
  std::unique_ptr<Workspace> workspace = std::make_unique<Workspace>();
  std::vector<float> out;
  const Model& model() const { return opened->model(); }
  OpContext Context() const { return OpContext(opened->threads(), &opened->kernels(), workspace.get()); }
};

// Touches every page of this rank's expert slices (one byte a page, split over the threads).
void ReadIn(const Model& m, const ThreadConfig& tc) {
  std::vector<std::pair<const uint8_t*, size_t>> ranges;
  for (int l = 0; m.MoeOfLayer(l) || l < m.config().num_layers; ++l) {
    const MoeWeights* w = m.MoeOfLayer(l);
    if (!w) continue;
    std::vector<const MlpWeights*> experts;
    for (const MlpWeights& e : w->experts) experts.push_back(&e);
    if (w->has_shared) experts.push_back(&w->shared);
    for (const MlpWeights* e : experts)
      for (const simd::WeightRef* r : {&e->gate, &e->up, &e->down}) {
        if (!r->data) continue;
        const simd::StoredSpan span = simd::RowTileSpan(*r, 0, MatMulRowTiles(*r));
        ranges.emplace_back(span.data, span.data_bytes);
        if (span.scale_bytes) ranges.emplace_back(span.scales, span.scale_bytes);
      }
  }
  std::atomic<uint64_t> sum{0};
  ParallelFor(tc, ranges.size(), 1, [&](size_t b, size_t e, int) {
    uint64_t s = 0;
    for (size_t i = b; i < e; ++i)
      for (size_t at = 0; at < ranges[i].second; at += 4096) s += ranges[i].first[at];
    sum += s;
  });
  static volatile uint64_t sink;  // keeps the reads
  sink = sink + sum.load();
}

std::string ToJson(const PartOptions& o) {
  return nlohmann::json{{"model", o.model_dir}, {"threads", o.threads}, {"numa", o.numa}, {"kernels", o.kernels}}.dump();
}

PartOptions FromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text);  // written by rank 0's ToJson
  return {j.at("model").get<std::string>(), j.at("threads").get<int>(), j.at("numa").get<std::string>(),
          j.at("kernels").get<std::string>()};
}

// Each rank's answer to kOpen, "" when its part opened, gathered on rank 0 ("error\nfingerprint").
std::vector<std::string> GatherText(MPI_Comm comm, int rank, int size, const std::string& mine) {
  int len = static_cast<int>(mine.size());
  std::vector<int> lens(static_cast<size_t>(size));
  MPI_Gather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, 0, comm);
  const std::vector<int> displs = Displacements(lens);
  std::vector<char> all(rank == 0 ? static_cast<size_t>(displs.back() + lens.back()) + 1 : 1);
  MPI_Gatherv(mine.data(), len, MPI_CHAR, all.data(), lens.data(), displs.data(), MPI_CHAR, 0, comm);
  std::vector<std::string> out;
  if (rank == 0)
    for (int q = 0; q < size; ++q)
      out.emplace_back(all.data() + displs[static_cast<size_t>(q)], static_cast<size_t>(lens[static_cast<size_t>(q)]));
  return out;
}

}  // namespace

StatusOr<std::unique_ptr<ExpertParallel>> ExpertParallel::Start(Group& group, const PartOptions& o) {
  if (group.rank() != 0) return Internal("only rank 0 starts the expert-parallel engine");
  std::unique_ptr<ExpertParallel> ep(new ExpertParallel(group));
  std::string text = ToJson(o);
  Header h{kOpen, 0, text.size()};
  Broadcast(group.mpi().work, &h);
  MPI_Bcast(text.data(), static_cast<int>(text.size()), MPI_CHAR, 0, group.mpi().work);
  return ep;
}

Status ExpertParallel::Connect(const Model& model) {
  for (int l = 0; l < model.config().num_layers; ++l)
    if (const MoeWeights* w = model.MoeOfLayer(l); w && (w->part.index != 0 || w->part.count != group_.size()))
      return Internal("expert parallelism: rank 0's model holds expert part ", w->part.index, " of ", w->part.count,
                      ", not 0 of ", group_.size());
  const std::string mine = "\n" + Fingerprint(model);
  const std::vector<std::string> answers = GatherText(group_.mpi().work, 0, group_.size(), mine);
  answered_ = true;
  std::string errors;
  for (int q = 1; q < group_.size(); ++q) {
    const std::string& a = answers[static_cast<size_t>(q)];
    const size_t nl = a.find('\n');
    const std::string error = a.substr(0, nl), fingerprint = nl == std::string::npos ? "" : a.substr(nl);
    if (!error.empty()) {
      errors += Str(errors.empty() ? "" : "; ", group_.Describe(q), ": ", error);
    } else if (fingerprint != mine) {
      errors += Str(errors.empty() ? "" : "; ", group_.Describe(q), " opened a different model (",
                    fingerprint.substr(1), ", rank 0 has ", mine.substr(1), ")");
    }
  }
  if (!errors.empty()) return Status(StatusCode::kUnavailable, "expert parallelism: " + errors);
  model_ = &model;
  return Status::Ok();
}

ExpertParallel::~ExpertParallel() {
  // Connect not reached (rank 0's own model failed): the followers still answer kOpen first.
  if (!answered_) GatherText(group_.mpi().work, 0, group_.size(), "");
  Header h{kClose, 0, 0};
  Broadcast(group_.mpi().work, &h);
}

Status ExpertParallel::Run(const OpContext& tc, int layer, const MoeWeights& w, const MoeParams& p, const float* x,
                           size_t n, float* out, int32_t* routed_ids) const {
  if (n == 0) return Status::Ok();
  M3_RETURN_IF_ERROR(group_.Health());
  std::lock_guard<std::mutex> lock(mu_);
  const double t0 = Now();
  const size_t hidden = w.router.cols, k = static_cast<size_t>(p.top_k);
  Payload payload(n, hidden, k);
  std::memcpy(payload.x(), x, n * hidden * sizeof(float));
  MoeRoute(tc, w, p, x, n, payload.ids(), payload.weights());
  if (routed_ids) std::memcpy(routed_ids, payload.ids(), n * k * sizeof(int32_t));
  MPI_Comm comm = group_.mpi().work;
  Header h{kMoe, layer, n};
  Broadcast(comm, &h);
  M3_RETURN_IF_ERROR(BroadcastBytes(comm, payload.bytes.data(), payload.bytes.size()));
  stats_.send_s += Now() - t0;
  stats_.bytes += (payload.bytes.size() + sizeof(Header)) * static_cast<uint64_t>(group_.size() - 1);
  MpiExchange ex(comm, 0, group_.size(), &stats_);
  M3_RETURN_IF_ERROR(MoePartForward(tc, w, p, x, n, payload.ids(), payload.weights(), ex, out));
  stats_.blocks += 1;
  stats_.tokens += n;
  stats_.total_s += Now() - t0;
  return Status::Ok();
}

ExchangeStats ExpertParallel::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void ExpertParallel::ResetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = {};
}

StatusOr<std::pair<double, uint64_t>> ExpertParallel::ProbeExchange(size_t tokens, int repeats,
                                                                   MoeSplitKind split) const {
  if (!model_) return Internal("ProbeExchange before Connect");
  M3_ASSIGN_OR_RETURN(const BlockShape shape, ShapeOf(*model_));
  std::lock_guard<std::mutex> lock(mu_);
  Header h{kProbe, repeats, tokens, static_cast<int32_t>(split)};
  Broadcast(group_.mpi().work, &h);
  ExchangeStats probe;
  const double t0 = Now();
  RunProbe(group_.mpi().work, 0, group_.size(), shape, tokens, repeats, split, &probe);
  const double per = (Now() - t0) / std::max(1, repeats);
  const uint64_t payload = tokens * shape.hidden * sizeof(float) + tokens * shape.k * 8 + sizeof(Header);
  return std::make_pair(per, probe.bytes / static_cast<uint64_t>(std::max(1, repeats)) +
                                 payload * static_cast<uint64_t>(group_.size() - 1));
}

void ExpertParallel::ReadExpertsIn() const {
  std::lock_guard<std::mutex> lock(mu_);
  Header h{kReadIn, 0, 0};
  Broadcast(group_.mpi().work, &h);
  MPI_Barrier(group_.mpi().work);
}

std::string ExpertParallel::Describe() const {
  std::string s = Str("experts split over ", group_.size(), " ranks:");
  bool one_host = true;
  for (int q = 0; q < group_.size(); ++q) {
    s += Str(q ? ", " : " ", group_.Describe(q));
    one_host = one_host && group_.host(q) == group_.host(0);
  }
  // Open MPI's transports: shared memory between ranks of one host, TCP (or a fabric) between hosts,
  // unless `--mca btl ...` (LaunchInfo::transports) leaves shared memory out.
  const std::string& btl = group_.transports();
  const bool names_shm = btl.find("vader") != std::string::npos || btl.find("sm") != std::string::npos;
  const bool shm_allowed = btl.empty() || (btl[0] == '^' ? !names_shm : names_shm);
  if (one_host) return s + (shm_allowed ? "; one host: shared memory" : Str("; one host: loopback (btl ", btl, ")"));
  return s + "; several hosts: TCP or the fabric Open MPI finds";
}

namespace {

// A follower's answer to kOpen: its part, or why it has none ("\nfingerprint" or the error).
std::string OpenFollowerPart(MPI_Comm comm, uint64_t bytes, const MoePart& slice, const OpenPartFn& open,
                             std::unique_ptr<Part>* part) {
  std::string text(bytes, '\0');
  MPI_Bcast(text.data(), static_cast<int>(bytes), MPI_CHAR, 0, comm);
  part->reset();
  try {
    auto opened = open(FromJson(text), slice);
    if (!opened.ok()) return opened.status().ToString();
    *part = std::make_unique<Part>();
    (*part)->opened = std::move(opened).value();
    return "\n" + Fingerprint((*part)->model());
  } catch (const std::exception& e) {
    return Str("cannot open its part: ", e.what());
  }
}

// Computes this rank's slice of a MoE block rank 0 broadcasts.
Status FollowBlock(MPI_Comm comm, int rank, int size, const Header& h, Part* part) {
  if (!part) return Internal("rank 0 sent a MoE block but this rank has no model open");
  const ModelConfig& c = part->model().config();
  const MoeWeights* w = part->model().MoeOfLayer(h.layer);
  if (!w) return Internal("rank 0 sent a MoE block for layer ", h.layer, ", which has no MoE");
  const MoeParams p = ParamsOf(c);
  Payload payload(h.n, static_cast<size_t>(c.hidden_size), static_cast<size_t>(p.top_k));
  M3_RETURN_IF_ERROR(BroadcastBytes(comm, payload.bytes.data(), payload.bytes.size()));
  part->out.resize(h.n * static_cast<size_t>(c.hidden_size));
  MpiExchange ex(comm, rank, size, nullptr);
  return MoePartForward(part->Context(), *w, p, payload.x(), h.n, payload.ids(), payload.weights(), ex,
                        part->out.data());
}

}  // namespace

Status RunFollower(Group& group, const OpenPartFn& open) {
  MPI_Comm comm = group.mpi().work;
  const int rank = group.rank(), size = group.size();
  std::unique_ptr<Part> part;
  std::optional<BlockShape> shape;
  for (;;) {
    Header h;
    Broadcast(comm, &h);
    switch (h.op) {
      case kOpen: {
        GatherText(comm, rank, size, OpenFollowerPart(comm, h.n, MoePart{rank, size}, open, &part));
        shape.reset();
        if (part) {
          auto s = ShapeOf(part->model());
          if (s.ok()) shape = *s;
        }
        break;
      }
      case kMoe:
        M3_RETURN_IF_ERROR(FollowBlock(comm, rank, size, h, part.get()));
        break;
      case kProbe:
        if (!shape) return Internal("rank 0 sent an exchange probe but this rank has no model open");
        RunProbe(comm, rank, size, *shape, h.n, h.layer, static_cast<MoeSplitKind>(h.split), nullptr);
        break;
      case kReadIn:
        if (part) ReadIn(part->model(), part->opened->threads());
        MPI_Barrier(comm);
        break;
      case kClose:
        part.reset();
        shape.reset();
        break;
      case kExit:
        return Status::Ok();
      default:
        return Internal("unknown command ", h.op, " from rank 0");
    }
  }
}

void EndJob(Group& group) {
  if (group.rank() != 0) return;
  Header h{kExit, 0, 0};
  Broadcast(group.mpi().work, &h);
}

}  // namespace m3::cluster
