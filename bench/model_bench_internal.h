// The two halves of `m3 bench` end to end (model_bench.h): model_bench.cc plans and measures a
// run into a Result, model_bench_report.cc reports it (one JSON object or the table).
#pragma once

#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/limits.h"
#include "bench/shapes.h"

namespace m3::bench {

// A figure with 3-4 significant digits, whatever its size; a byte count in KB, MB or GB.
std::string Num(double v);
std::string Bytes(double b);

// `--gpu dense`: the same prefill and decode again with the dense part offloaded (issue 34),
// on the same model in the same run, and where its time went. Times are per decode token
// (means over the steps), from the offload's own marks (OffloadStats).
struct OffloadResult {
  bool ran = false;
  std::string device;
  double ttft_s = 0, prefill_tok_s = 0, decode_tok_s = 0;
  double t_layer_s = 0, t_rest_s = 0, projected_tok_s = 0, projected_prefill_tok_s = 0;
  double device_s = 0, shared_s = 0, experts_s = 0, handoff_s = 0, selection_s = 0;
  double dense_bytes = 0;  // what one pass reads on the device (its whole dense part)
  double copy_gbps = 0;    // a device-to-device copy on the same device, bytes read + written
  // The dense part's read rate: its bytes over the device's time per token, shared experts included.
  double dense_gbps() const { return device_s > 0 ? dense_bytes / device_s / 1e9 : 0; }
  // Of the shared experts' device time, the part the CPU's routed experts could hide (both run at
  // once; an upper bound from per-token totals).
  double shared_overlap() const { return shared_s > 0 ? std::min(1.0, experts_s / shared_s) : 0; }
};

// Under `mpirun -np N` (expert parallelism, docs/DIST.md): rank 0's view of the exchanges in the
// decode phase, the exchanges alone (a probe without compute), and the projected 60-layer decode
// for other rank counts from the measured parts of a layer.
struct DistResult {
  bool ran = false;
  int ranks = 0;
  std::string ranks_described;      // ranks, hosts and the transport between them
  double bytes_per_token = 0;       // crossing between ranks per decode token (all MoE layers here)
  double bytes_per_layer = 0;       // of one MoE layer and one token
  double exchange_s = 0;            // one layer's exchanges alone, one token (probe median)
  double wait_s_per_token = 0;      // rank 0's time in the exchanges per decode token
  double wait_share = 0;            // of a decode step's time
  double block_s = 0;               // rank 0's time in one MoE block per token, exchanges included
  double compute_s = 0;             // of which its own compute (routing, its slices)
  double rest_of_layer_s = 0;       // a layer's time outside the MoE block (attention, norms)
  double expert_bytes_per_rank_full = 0;  // routed experts each rank holds with 60 layers (57 MoE)
  std::vector<std::pair<int, double>> projected_tok_s;  // ranks -> projected 60-layer decode tok/s
  // The other split, whole experts per rank, measured to compare: its exchanges alone (probe) and
  // the routed work of the slowest rank over an even share, for uniform top-k routing over
  // `ranks` ranks (expert e on rank e mod N; mean over 100000 drawn tokens).
  double whole_bytes_per_layer = 0, whole_exchange_s = 0, whole_slowest_share = 0;
};

// The result: every figure of a run, as the report prints it.
struct Result {
  std::string model_dir, model_kind;
  std::string pack_type;  // the generated model's; empty for a given model
  bool generated = false;
  double generation_s = 0, load_s = 0, read_in_s = 0;
  bool read_in = false;
  uint64_t weight_bytes = 0;
  int layers = 0, threads = 0, prompt_tokens = 0, decode_tokens = 0;
  std::string numa;
  double ttft_s = 0, prefill_tok_s = 0, prefill_ops = 0, prefill_gops = 0;  // ttft_s: median of prefill_s
  std::vector<double> prefill_s;
  std::vector<double> step_s;
  double decode_tok_s = 0, decode_tok_s_mean = 0;
  double bytes_per_token = 0, routed_bytes_per_token = 0, decode_gbps = 0;
  int64_t active_params = 0;
  int64_t disk_read_bytes = 0;
  double disk_read_mbps = 0;
  uint64_t peak_rss = 0;
  bool peak_rss_reset = false;  // the first probe's buffer is not in peak_rss
  // Decode steps paired with reads of as many cold weight bytes (read_gbps 0: not paired, the
  // weights not resident or too small to be cold).
  PairedSamples::Summary steps_paired;
  // The limit decode is judged by: the paired reads where there are some, else the best sample.
  double read_limit_gbps() const { return steps_paired.read_gbps > 0 ? steps_paired.read_gbps : read_bw.best; }
  // Per layer and lm_head apart (all layers of the generated model are MoE + sparse attention, as
  // 57 of the real 60), timed inside each pass (LayerClock).
  double t_rest_s = 0, t_layer_s = 0, projected_tok_s = 0, projected_bytes_per_token = 0;
  // Prefill: a full layer (the median run's mean over all but the last; 0 with one layer), the
  // last layer (keys and values of every row, the rest for the last row) and what follows it.
  double t_layer_prefill_s = 0, t_last_layer_prefill_s = 0, t_rest_prefill_s = 0, projected_prefill_tok_s = 0;
  double layer_bytes_per_token = 0, lm_head_bytes = 0;  // what one decode token reads of each
  double layer_share = 0, layer_share_full = 0;  // the layers' share of a decode token's bytes, here and with 60 layers
  double layer_gbps() const { return t_layer_s > 0 ? layer_bytes_per_token / t_layer_s / 1e9 : 0; }
  double lm_head_gbps() const { return t_rest_s > 0 ? lm_head_bytes / t_rest_s / 1e9 : 0; }
  double layer_prefill_gops = 0;  // a layer's int8 work per prefill over its time
  // A full layer's attention part (from the layer's start to its attention block's end: norm,
  // q/k/v and indexer projections, block selection, attention, o) in the median run; the rest of
  // the layer is its MoE block, of whose int8 work the routed experts do this share (the shared
  // expert the rest: both run in the block's same phases).
  double t_layer_prefill_attention_s = 0, moe_routed_share = 0;
  // The prompt's forward passes (each at most the session's prefill chunk of tokens) and the
  // weight bytes a full layer reads per chunk: its fixed matrices and the experts the chunk's
  // tokens routed to (their union), as measured.
  int prefill_chunk = 0, prefill_chunks = 0;
  std::string prefill_chunk_why;  // how the session chose it
  double layer_bytes_per_chunk = 0;
  double layer_params_per_token = 0;  // a layer's active parameters (top-k experts) per token
  // A chunk of the 60-layer model (every layer a full one): its bytes, the floors they and its
  // int8 work set at the run's best read sample and int8 peak, and its time as measured here.
  double chunk_bytes_full() const { return layer_bytes_per_chunk * static_cast<double>(shapes::kLayers); }
  double chunk_bandwidth_floor_s() const { return read_bw.best > 0 ? chunk_bytes_full() / read_bw.best / 1e9 : 0; }
  double chunk_compute_floor_s() const {
    return int8_peak.best > 0 ? 2.0 * layer_params_per_token * prefill_chunk * static_cast<double>(shapes::kLayers) / int8_peak.best / 1e9 : 0;
  }
  double chunk_s_full() const {
    return prefill_chunks > 0 ? t_layer_prefill_s / prefill_chunks * static_cast<double>(shapes::kLayers) : 0;
  }
  // -t with several counts: the prompt again at each (its own engine; the int8 peak probed at
  // that count right before it).
  struct PromptRow {
    int threads;
    double ttft_s, tok_s, gops, peak_gops, layer_s, attention_s, projected_tok_s;
  };
  std::vector<PromptRow> prompt_scaling;
  // Batched decode (batch > 1): medians of batched steps and of the single steps paired with them.
  int batch = 1, batch_steps = 0, batch_context = 0;
  double batch_step_s = 0, batch_single_step_s = 0, batch_bytes_per_step = 0;
  double batch_tok_s() const { return batch_step_s > 0 ? batch / batch_step_s : 0; }
  double batch_single_tok_s() const { return batch_single_step_s > 0 ? 1 / batch_single_step_s : 0; }
  double batch_gbps() const { return batch_step_s > 0 ? batch_bytes_per_step / batch_step_s / 1e9 : 0; }
  // The full model's bytes per batched step (as projected_bytes_per_token), and the speedup of a
  // batched step over `batch` single ones if both were bound by the bytes they read: with 60
  // layers the routed experts, which a batch shares only where its tokens chose the same ones,
  // weigh far more than in the benchmarked layers.
  double batch_projected_bytes_per_step = 0;
  double batch_projected_speedup() const {
    return batch_projected_bytes_per_step > 0 ? batch * projected_bytes_per_token / batch_projected_bytes_per_step : 0;
  }
  // Prompt lookup (lookup > 0): medians of verify steps over 1 + lookup tokens and of the single
  // steps paired with them; bytes a verify step reads, and projected to the full model.
  int lookup = 0, lookup_steps = 0;
  double lookup_step_s = 0, lookup_single_step_s = 0, lookup_bytes_per_step = 0, lookup_projected_bytes_per_step = 0;
  double lookup_cost() const { return lookup_single_step_s > 0 ? lookup_step_s / lookup_single_step_s : 0; }
  double lookup_projected_cost() const {
    return projected_bytes_per_token > 0 ? lookup_projected_bytes_per_step / projected_bytes_per_token : 0;
  }
  ProbeResult read_bw, int8_peak;
  bool logits_finite = true;
  double logits_rms = 0;  // of the last decode step: a sanity check of the synthetic weights
  double loadavg_start = 0, loadavg_end = 0;
  OffloadResult offload;
  DistResult dist;
};

// The result as one JSON line or the table; the logits warning goes to `log` as well.
void Report(const Result& r, bool json, FILE* out, FILE* log);

}  // namespace m3::bench
