// Expert parallelism over MPI (docs/DIST.md): every rank maps the same model and keeps slice r of
// N of every MoE layer's experts (ops/moe.h MoePart); rank 0 alone runs the dense part (attention,
// router, shared work, lm_head) and the command. For each MoE block rank 0 broadcasts the block's
// input rows and their routes, every rank computes its slice, the ranks all-gather the SwiGLU
// activation columns and rank 0 gathers the output columns. Nothing is summed across ranks, so the
// logits are bit for bit those of one process for any rank count and any network timing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "base/status.h"
#include "cluster/group.h"
#include "model/model.h"

namespace m3::cluster {

// What the followers need to open their part of the model, from rank 0's engine options.
struct PartOptions {
  std::string model_dir;  // the same path on every node (a shared filesystem or a copy per node)
  int threads = 0;        // 0: each node's CPUs, shared by the ranks on that node
  std::string numa = "off";
  std::string kernels = "auto";
};

// How the experts are split over the ranks: a row slice of every expert (what m3 does: every
// rank's work is the same whatever the routing), or whole experts per rank (fewer bytes to move,
// but a rank whose experts more tokens chose is slower, and the others wait for it).
enum class MoeSplitKind : int32_t { kSlices = 0, kWholeExperts = 1 };

// Rank 0's time and traffic in the MoE blocks of its passes since the last reset.
struct ExchangeStats {
  uint64_t blocks = 0, tokens = 0;  // MoE blocks run and their rows
  uint64_t bytes = 0;               // bytes that crossed between ranks (every rank's sends)
  double send_s = 0;                // the inputs and routes broadcast
  double activations_s = 0;         // the activation all-gather (waits for the slowest gate/up)
  double outputs_s = 0;             // the output gather (waits for the slowest down)
  double total_s = 0;               // the whole blocks, compute included
};

class ExpertParallel : public MoeRunner {
 public:
  // Asks the followers to open their part of `o.model_dir` (they load while rank 0 does).
  static StatusOr<std::unique_ptr<ExpertParallel>> Start(Group& group, const PartOptions& o);
  ~ExpertParallel() override;  // the followers drop their part
  // With rank 0's model loaded with slice 0 of the experts (ModelLoadOptions::expert_part {0, N}):
  // waits until every follower has opened its part and checks that all opened the same model;
  // then Run computes `model`'s MoE blocks (given to its passes as OpContext::moe_runner). Errors
  // name the rank and host that failed.
  Status Connect(const Model& model);

  // One MoE block over every rank; once the group has lost a rank, its status (Group::Health).
  Status Run(const OpContext& tc, int layer, const MoeWeights& w, const MoeParams& p, const float* x, size_t n,
             float* out, int32_t* routed_ids) const override;

  int ranks() const { return group_.size(); }
  ExchangeStats stats() const;
  void ResetStats();
  // The exchanges of one MoE block of `tokens` rows (each routed to top-k distinct experts)
  // without any compute, `repeats` times: seconds per block on rank 0, and bytes per block. For
  // the split m3 uses, or for whole experts per rank (the other way to split, measured to compare).
  StatusOr<std::pair<double, uint64_t>> ProbeExchange(size_t tokens, int repeats,
                                                      MoeSplitKind split = MoeSplitKind::kSlices) const;
  // The followers read their slices of the experts into memory (the first use of an expert would
  // otherwise fault its pages in from storage); returns when all have. Benchmarks call it, as
  // they read rank 0's weights in.
  void ReadExpertsIn() const;
  // E.g. "experts split over 2 ranks: rank 0 (host a), rank 1 (host a); one host: shared memory".
  std::string Describe() const;

 private:
  explicit ExpertParallel(Group& group) : group_(group) {}
  Group& group_;
  const Model* model_ = nullptr;
  bool answered_ = false;  // the followers' answers to the open are in
  mutable std::mutex mu_;  // one block at a time: the ranks follow one sequence of collectives
  mutable ExchangeStats stats_;
};

// Threads of a rank: -t when given (capped at its CPUs), else this node's CPUs shared by the
// ranks mpirun started on it.
int RankThreads(const Group& group, int requested);

// What a follower computes its slices with: the model opened with only its part of the experts
// (ModelLoadOptions::expert_part) and placed, its threads and kernels. The program opens it (an
// Engine with EngineOptions::expert_part, lib/runtime, which stands above this layer).
class FollowerPart {
 public:
  virtual ~FollowerPart() = default;
  virtual const Model& model() const = 0;
  virtual const ThreadConfig& threads() const = 0;
  virtual const Kernels& kernels() const = 0;
};
// Opens slice `part` of the model `o` names; its error goes back to rank 0, which reports it naming
// this rank and its host.
using OpenPartFn = std::function<StatusOr<std::unique_ptr<FollowerPart>>(const PartOptions& o, const MoePart& part)>;

// A follower's life: opens the parts rank 0 asks for (with `open`), computes its slices of their
// MoE blocks, until rank 0 ends the job (EndJob): then Ok. An error when rank 0 asks for what this
// rank cannot do (a block of a model it has not opened, a broken exchange); rank 0 then waits on
// this rank, so the program ends the job (Group::AbortJob).
Status RunFollower(Group& group, const OpenPartFn& open);
// Rank 0: the command is over; the followers return from RunFollower.
void EndJob(Group& group);

}  // namespace m3::cluster
