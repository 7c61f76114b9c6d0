// `m3 bench` end to end, the report (model_bench_internal.h): a measured Result as one JSON object
// or the table, each figure against its machine limit.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "bench/limits.h"
#include "bench/model_bench_internal.h"
#include "bench/shapes.h"
#include "ops/context.h"

#include "m3_commit.h"  // M3_COMMIT, written at build time

namespace m3::bench {

// A figure with 3-4 significant digits, whatever its size.
std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, std::fabs(v) >= 100 ? "%.1f" : std::fabs(v) >= 1 ? "%.2f" : "%.3g", v);
  return buf;
}

std::string Bytes(double b) {
  return b >= 1e9 ? Num(b / 1e9) + " GB" : b >= 1e6 ? Num(b / 1e6) + " MB" : Num(b / 1e3) + " KB";
}

namespace {

double Ratio(double v, double limit) { return limit > 0 ? v / limit : 0.0; }

// A work/limit ratio for JSON: the number when it is a ratio to a limit, else null (and the
// report's notes say why).
nlohmann::json RatioJson(const LimitRatio& r) { return r.valid ? nlohmann::json(r.ratio) : nlohmann::json(nullptr); }

// The ratios of the run that are judged against machine limits, with the notes of those that are not.
struct LimitRatios {
  LimitRatio decode, decode_paired, decode_best, layer, lm_head, prefill, layer_prefill, batch;
  std::vector<std::string> notes;
};

LimitRatios JudgeLimits(const Result& r) {
  LimitRatios j;
  const char* read_name = r.steps_paired.read_gbps > 0 ? "paired read bandwidth" : "best read sample";
  auto judge = [&](const char* what, double work, double limit, const char* limit_name) {
    LimitRatio l = RatioToLimit(work, limit, limit_name);
    if (!l.valid && limit > 0) j.notes.push_back(Str(what, ": ", l.note));
    return l;
  };
  j.decode = judge("decode", r.decode_gbps, r.read_limit_gbps(), read_name);
  j.decode_paired = judge("decode (paired)", r.decode_gbps, r.steps_paired.read_gbps, "paired read bandwidth");
  j.decode_best = judge("decode (best read)", r.decode_gbps, r.read_bw.best, "best read sample");
  j.layer = judge("decode, one layer", r.layer_gbps(), r.read_limit_gbps(), read_name);
  j.lm_head = judge("decode, lm_head", r.lm_head_gbps(), r.read_limit_gbps(), read_name);
  j.prefill = judge("prefill", r.prefill_gops, r.int8_peak.best, "int8 peak");
  j.layer_prefill = judge("prefill, one layer", r.layer_prefill_gops, r.int8_peak.best, "int8 peak");
  j.batch = judge("batched decode", r.batch_gbps(), r.read_bw.best, "best read sample");
  return j;
}

// The model, the run's settings and the machine.
nlohmann::json RunJson(const Result& r, const std::string& simd_target) {
  return {
      {"model_dir", r.model_dir},
      {"model_kind", r.model_kind},
      {"pack_type", r.pack_type},
      {"generated_now", r.generated},
      {"generation_s", r.generation_s},
      {"load_s", r.load_s},
      {"weights_read_in", r.read_in},
      {"read_in_s", r.read_in_s},
      {"weight_bytes", r.weight_bytes},
      {"layers", r.layers},
      {"prompt_tokens", r.prompt_tokens},
      {"decode_tokens", r.decode_tokens},
      {"threads", r.threads},
      {"numa", r.numa},
      {"cpu", CpuModel()},
      {"simd_target", simd_target},
      {"quant_kernels", Kernels().quant_name()},
      {"commit", M3_COMMIT},
      {"loadavg_start", r.loadavg_start},
      {"loadavg_end", r.loadavg_end},
  };
}

// Prefill and its compute against the int8 peak.
nlohmann::json PrefillJson(const Result& r, const LimitRatios& lr) {
  return {
      {"prefill_tok_s", r.prefill_tok_s},
      {"ttft_s", r.ttft_s},
      {"prefill_runs", r.prefill_s.size()},
      {"ttft_s_min", r.prefill_s.empty() ? 0 : *std::min_element(r.prefill_s.begin(), r.prefill_s.end())},
      {"prefill_ops", r.prefill_ops},
      {"prefill_gops", r.prefill_gops},
      {"int8_peak_gops", r.int8_peak.best},
      {"prefill_peak_ratio", RatioJson(lr.prefill)},
      {"active_params", r.active_params},
  };
}

// Decode: its bytes against the read limits, the process's storage reads and memory, the logits.
nlohmann::json DecodeJson(const Result& r, const LimitRatios& lr) {
  return {
      {"decode_tok_s", r.decode_tok_s},
      {"decode_tok_s_mean", r.decode_tok_s_mean},
      {"decode_step_s_median", Median(r.step_s)},
      {"decode_step_s_min", r.step_s.empty() ? 0 : *std::min_element(r.step_s.begin(), r.step_s.end())},
      {"bytes_per_token", r.bytes_per_token},
      {"routed_expert_bytes_per_token", r.routed_bytes_per_token},
      {"decode_gbps", r.decode_gbps},
      {"read_gbps", r.read_limit_gbps()},
      {"read_stat", r.steps_paired.read_gbps > 0 ? "median of the reads paired with the decode steps, fastest pattern"
                                                 : "best sample (weights not paired)"},
      {"decode_bw_ratio", RatioJson(lr.decode)},
      {"read_gbps_paired", r.steps_paired.read_gbps},
      {"read_paired_pattern", r.steps_paired.pattern},
      {"decode_bw_ratio_paired", RatioJson(lr.decode_paired)},
      {"decode_pair_ratio_median", r.steps_paired.ratio},
      {"fast_regime_steps", r.steps_paired.fast_pairs},
      {"fast_regime_ratio", r.steps_paired.fast_ratio},
      {"read_gbps_best", r.read_bw.best},
      {"read_gbps_best_median", r.read_bw.median()},
      {"read_pattern_best", r.read_bw.pattern},
      {"decode_bw_ratio_best", RatioJson(lr.decode_best)},
      {"limit_notes", lr.notes},
      {"disk_read_bytes", r.disk_read_bytes},
      {"disk_read_mbps", r.disk_read_mbps},
      {"peak_rss_bytes", r.peak_rss},
      {"peak_rss_excludes_probe", r.peak_rss_reset},
      {"logits_finite", r.logits_finite},
      {"logits_rms", r.logits_rms},
  };
}

// One layer and lm_head apart, and the projection to the full model.
nlohmann::json LayersJson(const Result& r, const LimitRatios& lr) {
  return {
      {"layer_bytes_per_token", r.layer_bytes_per_token},
      {"lm_head_bytes", r.lm_head_bytes},
      {"layer_share_of_bytes", r.layer_share},
      {"layer_share_of_bytes_full_model", r.layer_share_full},
      {"t_layer_s", r.t_layer_s},
      {"layer_gbps", r.layer_gbps()},
      {"layer_bw_ratio", RatioJson(lr.layer)},
      {"t_rest_s", r.t_rest_s},
      {"lm_head_gbps", r.lm_head_gbps()},
      {"lm_head_bw_ratio", RatioJson(lr.lm_head)},
      {"t_layer_prefill_s", r.t_layer_prefill_s},
      {"t_last_layer_prefill_s", r.t_last_layer_prefill_s},
      {"t_rest_prefill_s", r.t_rest_prefill_s},
      {"layer_prefill_gops", r.layer_prefill_gops},
      {"layer_prefill_peak_ratio", RatioJson(lr.layer_prefill)},
      {"t_layer_prefill_attention_s", r.t_layer_prefill_attention_s},
      {"t_layer_prefill_moe_s", r.t_layer_prefill_s - r.t_layer_prefill_attention_s},
      {"moe_routed_share_of_work", r.moe_routed_share},
      {"prefill_chunk", r.prefill_chunk},
      {"prefill_chunks", r.prefill_chunks},
      {"prefill_chunk_choice", r.prefill_chunk_why},
      {"layer_bytes_per_chunk", r.layer_bytes_per_chunk},
      {"full_model_chunk_bytes", r.chunk_bytes_full()},
      {"full_model_chunk_bandwidth_floor_s", r.chunk_bandwidth_floor_s()},
      {"full_model_chunk_compute_floor_s", r.chunk_compute_floor_s()},
      {"full_model_chunk_s", r.chunk_s_full()},
      {"projected_full_model_tok_s", r.projected_tok_s},
      {"projected_full_model_prefill_tok_s",
       r.projected_prefill_tok_s > 0 ? nlohmann::json(r.projected_prefill_tok_s) : nlohmann::json(nullptr)},
      {"projected_full_model_bytes_per_token", r.projected_bytes_per_token},
      {"projection_note",
       Str("all ", shapes::kLayers, " layers taken as this model's layers (the real model has ", shapes::kDenseLayers,
           " dense-attention + dense-MLP layers and ", shapes::kLayers - shapes::kDenseLayers,
           " MoE sparse ones); layers timed inside each pass; decode: 60 x the median step's mean layer + what "
           "follows the last layer (final norm, lm_head, argmax); prefill: 59 x a full layer (the mean of all but "
           "the last, in the median run) + the last layer (every row's keys and values, the rest for the last "
           "row) + what follows it; needs 2+ layers; assumes the weights stay in memory")},
  };
}

// The batched decode and prompt-lookup phases.
nlohmann::json PhasesJson(const Result& r, const LimitRatios& lr) {
  return {
      {"batch", r.batch},
      {"batch_steps", r.batch_steps},
      {"batch_context", r.batch_context},
      {"batch_tok_s", r.batch_tok_s()},
      {"batch_single_tok_s", r.batch_single_tok_s()},
      {"batch_speedup", Ratio(r.batch_tok_s(), r.batch_single_tok_s())},
      {"batch_bytes_per_step", r.batch_bytes_per_step},
      {"batch_gbps", r.batch_gbps()},
      {"batch_bw_ratio_best", RatioJson(lr.batch)},
      {"batch_projected_full_model_bytes_per_step", r.batch_projected_bytes_per_step},
      {"batch_projected_full_model_speedup", r.batch_projected_speedup()},
      {"lookup", r.lookup},
      {"lookup_steps", r.lookup_steps},
      {"lookup_step_ms", r.lookup_step_s * 1e3},
      {"lookup_single_step_ms", r.lookup_single_step_s * 1e3},
      {"lookup_step_cost", r.lookup_cost()},
      {"lookup_bytes_per_step", r.lookup_bytes_per_step},
      {"lookup_projected_full_model_step_cost", r.lookup_projected_cost()},
  };
}

// --gpu dense: the offloaded run beside the CPU-only one (null when not asked for).
nlohmann::json OffloadJson(const Result& r) {
  const OffloadResult& f = r.offload;
  if (!f.ran) return {{"offload", nullptr}};
  return {{"offload",
           {{"device", f.device},
            {"prefill_tok_s", f.prefill_tok_s},
            {"ttft_s", f.ttft_s},
            {"decode_tok_s", f.decode_tok_s},
            {"decode_speedup", Ratio(f.decode_tok_s, r.decode_tok_s)},
            {"prefill_speedup", Ratio(f.prefill_tok_s, r.prefill_tok_s)},
            {"projected_full_model_tok_s", f.projected_tok_s},
            {"projected_full_model_speedup", Ratio(f.projected_tok_s, r.projected_tok_s)},
            {"projected_full_model_prefill_tok_s", f.projected_prefill_tok_s},
            {"device_s_per_token", f.device_s},
            {"shared_experts_s_per_token", f.shared_s},
            {"cpu_experts_s_per_token", f.experts_s},
            {"handoff_s_per_token", f.handoff_s},
            {"selection_s_per_token", f.selection_s},
            {"dense_bytes_per_token", f.dense_bytes},
            {"dense_gbps", f.dense_gbps()},
            {"device_copy_gbps", f.copy_gbps},
            {"dense_gbps_over_copy", Ratio(f.dense_gbps(), f.copy_gbps)},
            {"shared_experts_overlap", f.shared_overlap()}}}};
}

// Expert parallelism under mpirun (null when not).
nlohmann::json DistJson(const Result& r) {
  const DistResult& d = r.dist;
  if (!d.ran) return {{"dist", nullptr}};
  nlohmann::json projected = nlohmann::json::object();
  for (const auto& [n, tok_s] : d.projected_tok_s) projected[std::to_string(n)] = tok_s;
  return {{"dist",
           {{"ranks", d.ranks},
            {"ranks_described", d.ranks_described},
            {"exchange_bytes_per_token", d.bytes_per_token},
            {"exchange_bytes_per_layer", d.bytes_per_layer},
            {"exchange_s_per_layer", d.exchange_s},
            {"network_wait_s_per_token", d.wait_s_per_token},
            {"network_wait_share", d.wait_share},
            {"moe_block_s", d.block_s},
            {"moe_compute_s", d.compute_s},
            {"rest_of_layer_s", d.rest_of_layer_s},
            {"expert_bytes_per_rank_full_model", d.expert_bytes_per_rank_full},
            {"projected_full_model_tok_s_by_ranks", projected},
            {"whole_experts_exchange_bytes_per_layer", d.whole_bytes_per_layer},
            {"whole_experts_exchange_s_per_layer", d.whole_exchange_s},
            {"whole_experts_slowest_rank_share", d.whole_slowest_share}}}};
}

// One JSON object (keys sorted, as nlohmann::json keeps them) of every group above.
nlohmann::json ToJson(const Result& r, const std::string& simd_target) {
  const LimitRatios lr = JudgeLimits(r);
  nlohmann::json j = RunJson(r, simd_target);
  j.update(OffloadJson(r));
  j.update(DistJson(r));
  for (const nlohmann::json& part : {PrefillJson(r, lr), DecodeJson(r, lr), LayersJson(r, lr), PhasesJson(r, lr)})
    j.update(part);
  nlohmann::json scaling = nlohmann::json::array();
  for (const Result::PromptRow& row : r.prompt_scaling)
    scaling.push_back({{"threads", row.threads},
                       {"ttft_s", row.ttft_s},
                       {"prefill_tok_s", row.tok_s},
                       {"prefill_gops", row.gops},
                       {"int8_peak_gops", row.peak_gops},
                       {"peak_ratio", Ratio(row.gops, row.peak_gops)},
                       {"t_layer_s", row.layer_s},
                       {"t_layer_attention_s", row.attention_s},
                       {"projected_full_model_prefill_tok_s", row.projected_tok_s}});
  j["prompt_scaling"] = scaling;
  return j;
}

// A table row; against a limit it prints its ratio when that is one (<= 1), else "above".
void PrintRow(FILE* out, const char* name, double v, const char* unit, double limit, const char* limit_kind,
              const std::string& note, const LimitRatio* judged = nullptr) {
  if (limit > 0 && judged && judged->valid)
    std::fprintf(out, "%-27s %10s %-6s %10s %-10s %6.3f\n", name, Num(v).c_str(), unit, Num(limit).c_str(),
                 limit_kind, judged->ratio);
  else if (limit > 0 && judged)
    std::fprintf(out, "%-27s %10s %-6s %10s %-10s %6s\n", name, Num(v).c_str(), unit, Num(limit).c_str(),
                 limit_kind, "above");
  else if (limit > 0)
    std::fprintf(out, "%-27s %10s %-6s %10s %-10s %6.3f\n", name, Num(v).c_str(), unit, Num(limit).c_str(),
                 limit_kind, v / limit);
  else
    std::fprintf(out, "%-27s %10s %-6s %s\n", name, Num(v).c_str(), unit, note.c_str());
}

// The model, machine and run, then the column heads.
void PrintHeading(const Result& r, const std::string& simd_target, FILE* out) {
  const std::string kind = r.model_kind == "given" ? "given model"
                           : Str(r.model_kind == "synthetic" ? "MiniMax-M3 shapes" : "tiny shapes", ", ", r.layers,
                                 " of ", shapes::kLayers, " layers, random ", r.pack_type, " weights");
  std::fprintf(out, "m3 bench: %s (%s)\n", r.model_dir.c_str(), kind.c_str());
  std::fprintf(out, "cpu %s | simd %s | quant kernels %s | %d threads, numa %s | commit %s | load %.2f -> %.2f\n",
               CpuModel().c_str(), simd_target.c_str(), Kernels().quant_name().c_str(), r.threads, r.numa.c_str(), M3_COMMIT,
               r.loadavg_start, r.loadavg_end);
  const std::string residency =
      r.read_in ? Str(" (read into memory in ", Num(r.read_in_s), " s)") : std::string(" (streamed from storage)");
  std::fprintf(out, "weights %s%s | active params per token %s M | prompt %d + decode %d tokens\n",
               Bytes(static_cast<double>(r.weight_bytes)).c_str(), residency.c_str(),
               Num(static_cast<double>(r.active_params) / 1e6).c_str(), r.prompt_tokens, r.decode_tokens);
  std::fprintf(out, "the layers read %.0f%% of a decode token's bytes here (the 60-layer model: %.0f%%)\n\n",
               100 * r.layer_share, 100 * r.layer_share_full);
  std::fprintf(out, "%-27s %10s %-6s %10s %-10s %6s\n", "", "value", "unit", "limit", "limit kind", "ratio");
}

// Prefill: throughput, time to first token, compute against the int8 peak, and its layers.
void PrintPrefillRows(const Result& r, const LimitRatios& lr, FILE* out) {
  PrintRow(out, "prefill", r.prefill_tok_s, "tok/s", 0, "", "");
  PrintRow(out, "time to first token", r.ttft_s, "s", 0, "",
           Str("median of ", r.prefill_s.size(), " prefills (fastest ",
               Num(r.prefill_s.empty() ? 0 : *std::min_element(r.prefill_s.begin(), r.prefill_s.end())), " s)"));
  PrintRow(out, "prefill compute", r.prefill_gops, "GOP/s", r.int8_peak.best, "int8_peak", "", &lr.prefill);
  if (r.t_layer_prefill_s > 0) {
    PrintRow(out, "  one layer", r.t_layer_prefill_s * 1e3, "ms", 0, "", Str(Num(r.layer_prefill_gops), " GOP/s"));
    PrintRow(out, "  one layer compute", r.layer_prefill_gops, "GOP/s", r.int8_peak.best, "int8_peak", "",
             &lr.layer_prefill);
  }
  if (r.t_layer_prefill_s > 0) {
    const double moe_s = r.t_layer_prefill_s - r.t_layer_prefill_attention_s;
    PrintRow(out, "    attention", r.t_layer_prefill_attention_s * 1e3, "ms", 0, "",
             Str(Num(100 * r.t_layer_prefill_attention_s / r.t_layer_prefill_s), "% of the layer: projections, indexer, attention"));
    PrintRow(out, "    MoE block", moe_s * 1e3, "ms", 0, "",
             Str(Num(100 * moe_s / r.t_layer_prefill_s), "% of the layer; routed experts ", Num(100 * r.moe_routed_share),
                 "% of its work, the shared expert the rest"));
  }
  PrintRow(out, "  last layer", r.t_last_layer_prefill_s * 1e3, "ms", 0, "",
           "keys and values of every row, the rest of one");
  PrintRow(out, "  lm_head and after", r.t_rest_prefill_s * 1e3, "ms", 0, "", "");
  if (r.layer_bytes_per_chunk > 0) {
    PrintRow(out, "prompt chunk", r.prefill_chunk, "tokens", 0, "",
             Str(r.prefill_chunks, " chunk(s); a layer reads ", Bytes(r.layer_bytes_per_chunk), " per chunk; ",
                 r.prefill_chunk_why));
    PrintRow(out, "  60-layer chunk", r.chunk_s_full(), "s", 0, "",
             Str("reads ", Bytes(r.chunk_bytes_full()), ": bandwidth floor ", Num(r.chunk_bandwidth_floor_s()),
                 " s (read_bw), compute floor ", Num(r.chunk_compute_floor_s()), " s (int8_peak)"));
  }
}

// -t with several counts: the prompt at each, its share of the int8 peak at that count, a full
// layer's parts, and the speedup over the first count against the threads' ratio.
void PrintPromptScaling(const Result& r, FILE* out) {
  if (r.prompt_scaling.empty()) return;
  std::fprintf(out, "\nprompt of %d tokens by threads (each count on its own engine; int8 peak probed at that count)\n",
               r.prompt_tokens);
  std::fprintf(out, "%7s %9s %9s %9s %7s %9s %9s %9s %8s %6s %12s\n", "threads", "tok/s", "GOP/s", "peak", "ratio",
               "layer ms", "attn ms", "MoE ms", "speedup", "eff", "60-layer t/s");
  const Result::PromptRow& first = r.prompt_scaling.front();
  for (const Result::PromptRow& row : r.prompt_scaling) {
    const double speedup = Ratio(row.tok_s, first.tok_s);
    const double eff = speedup / (static_cast<double>(row.threads) / first.threads);
    std::fprintf(out, "%7d %9s %9s %9s %7.3f %9s %9s %9s %8.2f %6.2f %12s\n", row.threads, Num(row.tok_s).c_str(),
                 Num(row.gops).c_str(), Num(row.peak_gops).c_str(), Ratio(row.gops, row.peak_gops),
                 Num(row.layer_s * 1e3).c_str(), Num(row.attention_s * 1e3).c_str(),
                 Num((row.layer_s - row.attention_s) * 1e3).c_str(), speedup, eff,
                 row.projected_tok_s > 0 ? Num(row.projected_tok_s).c_str() : "-");
  }
}

// Decode: throughput, bytes per token and their bandwidth against the read limits; one layer and
// lm_head apart.
void PrintDecodeRows(const Result& r, const LimitRatios& lr, FILE* out) {
  const PairedSamples::Summary& sp = r.steps_paired;
  const char* read_kind = sp.read_gbps > 0 ? "paired" : "read_bw";
  PrintRow(out, "decode (median step)", r.decode_tok_s, "tok/s", 0, "",
           Str("mean ", Num(r.decode_tok_s_mean), " tok/s"));
  PrintRow(out, "weights read per token", r.bytes_per_token / 1e6, "MB", 0, "",
           Str("routed experts ", Num(r.routed_bytes_per_token / 1e6), " MB"));
  PrintRow(out, "decode bandwidth", r.decode_gbps, "GB/s", r.read_limit_gbps(), read_kind, "", &lr.decode);
  if (sp.read_gbps > 0) {
    if (sp.fast_pairs > 0)
      std::fprintf(out, "  steps in a fast regime     %10zu steps  %10s %-10s %6.3f\n", sp.fast_pairs, "", "paired",
                   sp.fast_ratio);
    PrintRow(out, "  vs best read sample", r.decode_gbps, "GB/s", r.read_bw.best, "read_bw", "", &lr.decode_best);
  }
  PrintRow(out, "  one layer", r.t_layer_s * 1e3, "ms", 0, "",
           Str(Bytes(r.layer_bytes_per_token), ", ", Num(r.layer_gbps()), " GB/s"));
  PrintRow(out, "  one layer bandwidth", r.layer_gbps(), "GB/s", r.read_limit_gbps(), read_kind, "", &lr.layer);
  PrintRow(out, "  lm_head", r.t_rest_s * 1e3, "ms", 0, "",
           Str(Bytes(r.lm_head_bytes), ", ", Num(r.lm_head_gbps()), " GB/s"));
  PrintRow(out, "  lm_head bandwidth", r.lm_head_gbps(), "GB/s", r.read_limit_gbps(), read_kind, "", &lr.lm_head);
}

// The batched decode and prompt-lookup phases, where they ran.
void PrintPhaseRows(const Result& r, const LimitRatios& lr, FILE* out) {
  if (r.batch > 1) {
    PrintRow(out, Str("decode, ", r.batch, " sequences").c_str(), r.batch_tok_s(), "tok/s", r.batch_single_tok_s(),
             "1 seq", "");
    PrintRow(out, "  weights read per step", r.batch_bytes_per_step / 1e6, "MB", 0, "", "");
    PrintRow(out, "  bandwidth", r.batch_gbps(), "GB/s", r.read_bw.best, "read_bw", "", &lr.batch);
    PrintRow(out, "  projected 60-layer speedup", r.batch_projected_speedup(), "x", 0, "",
             Str("if bound by bytes read: ", Bytes(r.batch_projected_bytes_per_step), "/step against ", r.batch, " x ",
                 Bytes(r.projected_bytes_per_token)));
  }
  if (r.lookup > 0) {
    PrintRow(out, Str("lookup verify, 1 + ", r.lookup, " tokens").c_str(), r.lookup_step_s * 1e3, "ms",
             r.lookup_single_step_s * 1e3, "1 token", "");
    PrintRow(out, "  break-even", r.lookup_cost() - 1, "tokens", 0, "", "accepted guesses per step");
    PrintRow(out, "  weights read per step", r.lookup_bytes_per_step / 1e6, "MB", 0, "", "");
    PrintRow(out, "  projected 60-layer cost", r.lookup_projected_cost(), "steps", 0, "",
             Str("if bound by bytes read: break-even at ", Num(r.lookup_projected_cost() - 1), " accepted guesses"));
  }
}

// Storage reads and memory, then the projections to the 60-layer model.
void PrintProjectionRows(const Result& r, FILE* out) {
  PrintRow(out, "disk reads during decode", r.disk_read_mbps, "MB/s", 0, "", "");
  PrintRow(out, "peak RSS", static_cast<double>(r.peak_rss) / 1e9, "GB", 0, "",
           r.peak_rss_reset ? "" : "includes the 1st probe's buffer");
  if (r.projected_prefill_tok_s > 0)
    PrintRow(
        out, "projected 60-layer prefill", r.projected_prefill_tok_s, "tok/s", 0, "",
        Str(Num(r.t_layer_prefill_s * 1e3), " ms/layer x ", shapes::kLayers - 1, " + ",
            Num(r.t_last_layer_prefill_s * 1e3), " ms last layer + ", Num(r.t_rest_prefill_s * 1e3), " ms lm_head"));
  else
    std::fprintf(out, "%-27s %10s %-6s %s\n", "projected 60-layer prefill", "-", "tok/s",
                 "needs 2+ layers (the last layer of a prompt runs one row past its keys and values)");
  PrintRow(out, "projected 60-layer decode", r.projected_tok_s, "tok/s", 0, "",
           Str(Num(r.t_layer_s * 1e3), " ms/layer x ", shapes::kLayers, " + ", Num(r.t_rest_s * 1e3), " ms lm_head, ",
               Bytes(r.projected_bytes_per_token), "/token"));
}

// What the limits and figures are, and the limits the work went above.
void PrintNotes(const Result& r, const LimitRatios& lr, FILE* out) {
  const PairedSamples::Summary& sp = r.steps_paired;
  std::fprintf(out,
               "\nread_bw: best of %zu samples before and after the run (%s; median %s GB/s); int8_peak: best of %zu "
               "(median %s GOP/s).\n",
               r.read_bw.samples.size(), r.read_bw.pattern.c_str(), Num(r.read_bw.median()).c_str(),
               r.int8_peak.samples.size(), Num(r.int8_peak.median()).c_str());
  if (sp.read_gbps > 0)
    std::fprintf(out,
                 "paired: median read of as many cold weight bytes right after each decode step, the read patterns "
                 "taken in turn and the fastest one's (%s) the limit decode is judged by: the host's bandwidth "
                 "switches between regimes, and the read at the moment of the work is its yardstick. Steps in a fast "
                 "regime: those whose read was >= %.1fx the median, with their median step GB/s / read GB/s.\n",
                 sp.pattern, PairedSamples::kFastRegime);
  else
    std::fprintf(out, "not paired: the weights (%s) are %s, so decode is judged by the best read sample.\n",
                 Bytes(static_cast<double>(r.weight_bytes)).c_str(),
                 r.read_in ? "too few to be read cold from memory" : "not resident");
  for (const std::string& note : lr.notes) std::fprintf(out, "above its limit: %s\n", note.c_str());
  std::fprintf(out,
               "prefill compute: 2 x the active parameters of every layer but the last per prompt token, the last "
               "layer's key and value projections per token and all of it once, lm_head once (last row).\n"
               "one layer: timed inside each pass as the layers end; decode, the median step's mean layer, and "
               "lm_head = what follows the last layer (final norm, lm_head, argmax); prefill, the mean of the layers "
               "but the last (which runs one row past its keys and values), median of the runs.\n"
               "projection: all %zu layers taken as MoE + sparse-attention layers (the real model has %zu dense "
               "ones), weights in memory.\n",
               shapes::kLayers, shapes::kDenseLayers);
  if (r.batch > 1)
    std::fprintf(out,
                 "decode, %d sequences: aggregate tok/s of batched steps (median of %d) against one sequence's steps "
                 "paired with them, all at %d-token contexts; per step the weights are read once, the routed "
                 "experts as the union of the batch's choices.\n",
                 r.batch, r.batch_steps, r.batch_context);
  if (r.lookup > 0)
    std::fprintf(out,
                 "lookup verify: a pass over a sampled token and %d guesses copied from the context (every row's "
                 "logits; median of %d), against single steps paired with them; --lookup K generates 1 + the "
                 "accepted guesses per such step, so it is faster when more are accepted than the break-even.\n",
                 r.lookup, r.lookup_steps);
  if (!r.logits_finite) std::fprintf(out, "warning: some logits were not finite\n");
}

// --gpu dense: the offloaded run against the CPU-only one above, and where its decode time went.
void PrintOffloadRows(const Result& r, FILE* out) {
  const OffloadResult& f = r.offload;
  if (!f.ran) return;
  std::fprintf(out, "\n--gpu dense on %s (same model, same run)\n", f.device.c_str());
  PrintRow(out, "prefill", f.prefill_tok_s, "tok/s", 0, "",
           Str(Num(Ratio(f.prefill_tok_s, r.prefill_tok_s)), "x the CPU-only prefill"));
  PrintRow(out, "decode", f.decode_tok_s, "tok/s", 0, "",
           Str(Num(Ratio(f.decode_tok_s, r.decode_tok_s)), "x the CPU-only decode"));
  PrintRow(out, "  dense part on the device", f.device_s * 1e3, "ms", 0, "",
           Str(Bytes(f.dense_bytes), " of weights per token, device time per token"));
  const LimitRatio dense = RatioToLimit(f.dense_gbps(), f.copy_gbps, "device copy");
  PrintRow(out, "  its read rate", f.dense_gbps(), "GB/s", f.copy_gbps, "copy GB/s",
           "a device-to-device copy of 512 MiB (read + written) in the same run", &dense);
  PrintRow(out, "  of which shared experts", f.shared_s * 1e3, "ms", 0, "",
           Str(Num(f.shared_overlap() * 100), "% of it can run under the CPU's routed experts"));
  PrintRow(out, "  routed experts on the CPU", f.experts_s * 1e3, "ms", 0, "", "");
  PrintRow(out, "  block selection (host)", f.selection_s * 1e3, "ms", 0, "", "scores to the host, blocks back");
  PrintRow(out, "  handoffs and the rest", f.handoff_s * 1e3, "ms", 0, "",
           "wall time less the device's, the experts' and the selection's: copies, waits, launches");
  if (f.projected_prefill_tok_s > 0) PrintRow(out, "projected 60-layer prefill", f.projected_prefill_tok_s, "tok/s", 0, "", "");
  PrintRow(out, "projected 60-layer decode", f.projected_tok_s, "tok/s", 0, "",
           Str(Num(Ratio(f.projected_tok_s, r.projected_tok_s)), "x the CPU-only projection (",
               Num(f.t_layer_s * 1e3), " ms/layer x ", shapes::kLayers, " + ", Num(f.t_rest_s * 1e3), " ms lm_head)"));
}

// mpirun -np N: the exchanges of the decode above and the projection over rank counts.
void PrintDistRows(const Result& r, FILE* out) {
  const DistResult& d = r.dist;
  if (!d.ran) return;
  std::fprintf(out, "\nexpert parallelism: %s\n", d.ranks_described.c_str());
  PrintRow(out, "exchanged per token", d.bytes_per_token / 1e3, "KB", 0, "",
           Str(Num(d.bytes_per_layer / 1e3), " KB per MoE layer: inputs and routes out, activation columns "
               "all-gathered, output columns back (every rank's sends)"));
  PrintRow(out, "one layer's exchange", d.exchange_s * 1e6, "us", 0, "",
           "the three collectives of one token's MoE layer alone, no compute (median of 5 x 20)");
  PrintRow(out, "network wait per token", d.wait_s_per_token * 1e3, "ms", 0, "",
           Str(Num(d.wait_share * 100), "% of a decode step: rank 0 in the collectives, waiting on the network and "
               "on slower ranks"));
  PrintRow(out, "MoE block per layer", d.block_s * 1e3, "ms", 0, "",
           Str("rank 0: ", Num(d.compute_s * 1e3), " ms its own compute; the layer's rest ",
               Num(d.rest_of_layer_s * 1e3), " ms"));
  PrintRow(out, "routed experts per rank", d.expert_bytes_per_rank_full / 1e9, "GB", 0, "",
           Str("with the real 60 layers over ", d.ranks, " ranks (the dense part on rank 0 only)"));
  PrintRow(out, "whole experts instead", d.whole_exchange_s * 1e6, "us", 0, "",
           Str(Num(d.whole_bytes_per_layer / 1e3), " KB per layer (no activations move), but its slowest rank has ",
               Num(d.whole_slowest_share), "x an even share of the routed experts (uniform top-k)"));
  for (const auto& [n, tok_s] : d.projected_tok_s)
    PrintRow(out, Str("projected 60-layer decode, ", n, n == 1 ? " rank" : " ranks").c_str(), tok_s, "tok/s", 0, "",
             "the layer's rest + rank 0's compute x ranks here / N + the exchange measured here");
}

void PrintTable(const Result& r, const std::string& simd_target, FILE* out) {
  const LimitRatios lr = JudgeLimits(r);
  PrintHeading(r, simd_target, out);
  PrintPrefillRows(r, lr, out);
  PrintDecodeRows(r, lr, out);
  PrintPhaseRows(r, lr, out);
  PrintProjectionRows(r, out);
  PrintOffloadRows(r, out);
  PrintDistRows(r, out);
  PrintPromptScaling(r, out);
  PrintNotes(r, lr, out);
}

}  // namespace

// The JSON line or the table (model_bench_internal.h).
void Report(const Result& r, bool json, FILE* out, FILE* log) {
  const std::string simd_target = Kernels().target();
  if (!r.logits_finite) std::fprintf(log, "m3 bench: warning: some logits were not finite\n");
  if (json) {
    std::fprintf(out, "%s\n", ToJson(r, simd_target).dump().c_str());
  } else {
    PrintTable(r, simd_target, out);
  }
}

}  // namespace m3::bench
