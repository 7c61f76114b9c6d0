// The llama.cpp side of the peer benchmark (bench/peer/peer_bench.py). Built by
// bench/peer/setup.sh against the prebuilt CPU libraries of node-llama-cpp (llama.cpp v0.5.0) and
// the headers of the llama.cpp source bundled in that package; it is not part of the m3 build.
//
//   llama_peer gen   --out FILE.gguf --layers L --type q8|q4|q4-mixed|q3-mixed|q2-mixed
//       writes a MiniMax-M3 GGUF (llama.cpp's `minimax-m3` architecture) with the real layer
//       shapes of bench/shapes.h, L layers that are all MoE + sparse attention (as m3's
//       generated bench model), random weights in the quant mix that mirrors an m3 pack type:
//       q4-mixed = routed experts Q4_0 and every other matrix Q8_0; q4 = all Q4_0; q8 = all Q8_0;
//       q3-mixed / q2-mixed = routed experts Q3_K / Q2_K (quantized by ggml from random values of
//       the same variance), every other matrix Q8_0; all-types = every ggml type m3 pack takes,
//       a matrix role each (experts Q2_K / Q3_K / Q4_K, attention Q6_K / Q5_K / Q8_0 / Q4_0,
//       shared expert Q4_K / Q5_K / Q6_K, indexer Q8_0 / BF16, embedding F16, output BF16);
//       norms, router and correction bias F32 (as m3 keeps them). Values as m3's generator picks
//       them: codes uniform, scales such that each matrix maps unit-variance inputs to
//       unit-variance outputs, router logits of unit variance, bias 0, norms 1 (llama.cpp stores
//       Gemma's 1 + w).
//   llama_peer bench --model FILE.gguf --libs DIR [-t T] [-p 512] [-n 64] [--split-steps 16]
//                    [--no-repack]
//       runs llama.cpp as its users do (mmap, its CPU thread pool, flash attention on, weights
//       repacked at load where its CPU backend does that by default) and prints one JSON object
//       with m3 bench's field names: prefill of p random ids (after an untimed warm-up prefill;
//       the median of up to three, each timed layer by layer as well), then n greedy
//       single-token decode steps (median step), then --split-steps more steps timed layer by
//       layer (LayerEnds), whose per-layer and lm_head times give the projected 60-layer
//       figures as m3 bench computes them. Like m3, llama.cpp runs the last layer of a prompt
//       past attention for the rows that give logits only.
//   llama_peer greedy --model FILE.gguf --libs DIR --ids 1,2,3 [-n 64] [-t T]
//       one prefill of the ids and n greedy steps (as m3 logits runs them); prints one JSON object:
//       the n + 1 greedy ids and the logits of the prompt's last row, for parity checks
//       (bench/peer/golden_parity.py).
#include <ggml-backend.h>
#include <ggml.h>
#include <gguf.h>
#include <llama.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/statvfs.h>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

// ---- shapes (bench/shapes.h) -------------------------------------------------------------------
constexpr int64_t kHidden = 6144, kVocab = 200064, kHeads = 64, kKvHeads = 4, kHeadDim = 128, kRotary = 64;
constexpr int64_t kIndexHeads = 4, kIndexDim = 128, kBlock = 128, kTopkBlocks = 16, kLocalBlocks = 1;
constexpr int64_t kExperts = 128, kTopK = 4, kExpertInter = 3072, kSharedInter = 3072, kDenseInter = 12288;

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

[[noreturn]] void Die(const std::string& msg) {
  std::fprintf(stderr, "llama_peer: %s\n", msg.c_str());
  std::exit(1);
}

uint64_t Mix64(uint64_t z) {  // SplitMix64 finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// ---- gen ---------------------------------------------------------------------------------------

enum class Fill { kQuant, kOnes, kZeros, kRouter };

struct TensorPlan {
  std::string name;
  ggml_type type;
  std::vector<int64_t> ne;  // ggml order: ne[0] = inputs (columns)
  Fill fill;
  double fan_in;            // scales: unit-variance outputs from unit-variance inputs
};

int64_t Elements(const TensorPlan& t) {
  int64_t n = 1;
  for (int64_t v : t.ne) n *= v;
  return n;
}

// Writes `bytes` of tensor t starting at its element 0, block by block, filled in parallel.
void WriteTensor(FILE* f, const TensorPlan& t, uint64_t seed, int threads) {
  const size_t row_bytes = ggml_row_size(t.type, t.ne[0]);
  const size_t rows = static_cast<size_t>(Elements(t) / t.ne[0]);
  constexpr size_t kChunkRows = 256;
  std::vector<uint8_t> buf(row_bytes * kChunkRows);
  const bool q8 = t.type == GGML_TYPE_Q8_0;
  // Codes drawn directly for Q8_0 and Q4_0; every other type from values ggml converts itself.
  const bool from_values = t.type != GGML_TYPE_Q8_0 && t.type != GGML_TYPE_Q4_0;
  // RMS of the codes: Q8_0 uniform in [-127, 127]; Q4_0 nibbles uniform in 0..15, value q - 8.
  const double code_rms = q8 ? std::sqrt(127.0 * 128.0 * 255.0 / 3.0 / 255.0) : std::sqrt(344.0 / 16.0);
  const float amplitude = static_cast<float>(1.0 / (code_rms * std::sqrt(t.fan_in)));
  for (size_t r0 = 0; r0 < rows; r0 += kChunkRows) {
    const size_t nr = std::min(kChunkRows, rows - r0);
    auto fill_rows = [&](size_t b, size_t e) {
      for (size_t r = b; r < e; ++r) {
        uint8_t* out = buf.data() + r * row_bytes;
        uint64_t s = Mix64(seed ^ Mix64(r0 + r + 1));
        auto next = [&] { return Mix64(s += 0x9E3779B97F4A7C15ull); };
        auto uniform = [&] { return static_cast<float>(next() >> 40) * 0x1p-24f; };
        switch (t.fill) {
          case Fill::kOnes:
          case Fill::kZeros:
          case Fill::kRouter: {
            float* v = reinterpret_cast<float*>(out);
            const float a = static_cast<float>(std::sqrt(3.0 / t.fan_in));
            for (int64_t i = 0; i < t.ne[0]; ++i)
              v[i] = t.fill == Fill::kOnes ? 1.0f : t.fill == Fill::kZeros ? 0.0f : a * (2.0f * uniform() - 1.0f);
            break;
          }
          case Fill::kQuant: {
            if (from_values) {  // ggml's own quantizer on uniform values of variance 1 / fan_in
              std::vector<float> v(static_cast<size_t>(t.ne[0]));
              const float a = static_cast<float>(std::sqrt(3.0 / t.fan_in));
              for (float& x : v) x = a * (2.0f * uniform() - 1.0f);
              ggml_quantize_chunk(t.type, v.data(), out, 0, 1, t.ne[0], nullptr);
              break;
            }
            const size_t block_bytes = q8 ? 34 : 18, codes = q8 ? 32 : 16;
            for (int64_t b = 0; b < t.ne[0] / 32; ++b) {
              uint8_t* blk = out + static_cast<size_t>(b) * block_bytes;
              const ggml_fp16_t d = ggml_fp32_to_fp16(amplitude * (0.75f + 0.5f * uniform()));
              std::memcpy(blk, &d, 2);
              for (size_t j = 0; j < codes; j += 8) {
                uint64_t v = next();
                if (q8)  // bytes uniform in [-127, 127]: map -128 to 0
                  for (int k = 0; k < 8; ++k) {
                    int8_t c = static_cast<int8_t>(v >> (8 * k));
                    blk[2 + j + k] = static_cast<uint8_t>(c == -128 ? 0 : c);
                  }
                else
                  std::memcpy(blk + 2 + j, &v, 8);
              }
            }
            break;
          }
        }
      }
    };
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i)
      pool.emplace_back(fill_rows, nr * static_cast<size_t>(i) / threads, nr * static_cast<size_t>(i + 1) / threads);
    for (auto& th : pool) th.join();
    if (std::fwrite(buf.data(), 1, nr * row_bytes, f) != nr * row_bytes) Die("write failed (disk full?)");
  }
}

// The type of each matrix role: the routed experts' projections, the attention's, the shared
// expert's, the indexer's and the embedding / output.
struct QuantMix {
  ggml_type gate_exps, up_exps, down_exps, attn_q, attn_k, attn_v, attn_output, gate_shexp, up_shexp, down_shexp,
      index_q, index_k, embd, output;
};

QuantMix MixOf(const std::string& type) {
  auto uniform = [](ggml_type experts, ggml_type rest) {
    return QuantMix{experts, experts, experts, rest, rest, rest, rest, rest, rest, rest, rest, rest, rest, rest};
  };
  if (type == "q4-mixed") return uniform(GGML_TYPE_Q4_0, GGML_TYPE_Q8_0);
  if (type == "q4") return uniform(GGML_TYPE_Q4_0, GGML_TYPE_Q4_0);
  if (type == "q8") return uniform(GGML_TYPE_Q8_0, GGML_TYPE_Q8_0);
  if (type == "q3-mixed") return uniform(GGML_TYPE_Q3_K, GGML_TYPE_Q8_0);
  if (type == "q2-mixed") return uniform(GGML_TYPE_Q2_K, GGML_TYPE_Q8_0);
  // Every ggml type m3 pack takes, a role each (a check of the GGUF import, not a bench mix).
  if (type == "all-types")
    return QuantMix{GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q5_K,
                    GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
                    GGML_TYPE_Q8_0, GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_BF16};
  Die("--type must be q8, q4, q4-mixed, q3-mixed, q2-mixed or all-types");
}

int Gen(const std::string& out, int layers, const std::string& type) {
  if (layers < 1 || layers > 60) Die("--layers must be 1..60");
  const QuantMix mix = MixOf(type);

  std::vector<TensorPlan> plan;
  auto matrix = [&](std::string name, ggml_type t, std::vector<int64_t> ne, double fan_in) {
    plan.push_back({std::move(name), t, std::move(ne), Fill::kQuant, fan_in});
  };
  auto vec = [&](std::string name, int64_t n, Fill fill) { plan.push_back({std::move(name), GGML_TYPE_F32, {n}, fill, 1}); };
  matrix("token_embd.weight", mix.embd, {kHidden, kVocab}, 1.0);
  for (int l = 0; l < layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    vec(p + "attn_norm.weight", kHidden, Fill::kOnes);
    matrix(p + "attn_q.weight", mix.attn_q, {kHidden, kHeads * kHeadDim}, kHidden);
    matrix(p + "attn_k.weight", mix.attn_k, {kHidden, kKvHeads * kHeadDim}, kHidden);
    matrix(p + "attn_v.weight", mix.attn_v, {kHidden, kKvHeads * kHeadDim}, kHidden);
    matrix(p + "attn_output.weight", mix.attn_output, {kHeads * kHeadDim, kHidden}, kHeads * kHeadDim);
    vec(p + "attn_q_norm.weight", kHeadDim, Fill::kOnes);
    vec(p + "attn_k_norm.weight", kHeadDim, Fill::kOnes);
    vec(p + "ffn_norm.weight", kHidden, Fill::kOnes);
    plan.push_back({p + "ffn_gate_inp.weight", GGML_TYPE_F32, {kHidden, kExperts}, Fill::kRouter, kHidden});
    vec(p + "exp_probs_b.bias", kExperts, Fill::kZeros);
    matrix(p + "ffn_gate_exps.weight", mix.gate_exps, {kHidden, kExpertInter, kExperts}, kHidden);
    matrix(p + "ffn_up_exps.weight", mix.up_exps, {kHidden, kExpertInter, kExperts}, kHidden);
    matrix(p + "ffn_down_exps.weight", mix.down_exps, {kExpertInter, kHidden, kExperts}, kExpertInter);
    matrix(p + "ffn_gate_shexp.weight", mix.gate_shexp, {kHidden, kSharedInter}, kHidden);
    matrix(p + "ffn_up_shexp.weight", mix.up_shexp, {kHidden, kSharedInter}, kHidden);
    matrix(p + "ffn_down_shexp.weight", mix.down_shexp, {kSharedInter, kHidden}, kSharedInter);
    matrix(p + "indexer.q_proj.weight", mix.index_q, {kHidden, kIndexHeads * kIndexDim}, kHidden);
    matrix(p + "indexer.k_proj.weight", mix.index_k, {kHidden, kIndexDim}, kHidden);
    vec(p + "indexer.q_norm.weight", kIndexDim, Fill::kOnes);
    vec(p + "indexer.k_norm.weight", kIndexDim, Fill::kOnes);
  }
  vec("output_norm.weight", kHidden, Fill::kOnes);
  matrix("output.weight", mix.output, {kHidden, kVocab}, kHidden);

  gguf_context* g = gguf_init_empty();
  const char* arch = "minimax-m3";
  auto key = [&](const char* k) { return std::string(arch) + "." + k; };
  gguf_set_val_str(g, "general.architecture", arch);
  gguf_set_val_str(g, "general.name", ("m3 peer bench: MiniMax-M3 shapes, random " + type).c_str());
  gguf_set_val_u32(g, "general.alignment", 32);
  gguf_set_val_str(g, "tokenizer.ggml.model", "none");
  gguf_set_val_u32(g, key("vocab_size").c_str(), kVocab);
  gguf_set_val_u32(g, key("context_length").c_str(), 1u << 20);
  gguf_set_val_u32(g, key("embedding_length").c_str(), kHidden);
  gguf_set_val_u32(g, key("block_count").c_str(), static_cast<uint32_t>(layers));
  gguf_set_val_u32(g, key("feed_forward_length").c_str(), kDenseInter);
  gguf_set_val_u32(g, key("expert_feed_forward_length").c_str(), kExpertInter);
  gguf_set_val_u32(g, key("attention.head_count").c_str(), kHeads);
  gguf_set_val_u32(g, key("attention.head_count_kv").c_str(), kKvHeads);
  gguf_set_val_u32(g, key("attention.key_length").c_str(), kHeadDim);
  gguf_set_val_u32(g, key("attention.value_length").c_str(), kHeadDim);
  gguf_set_val_u32(g, key("rope.dimension_count").c_str(), kRotary);
  gguf_set_val_f32(g, key("rope.freq_base").c_str(), 5e6f);
  gguf_set_val_f32(g, key("attention.layer_norm_rms_epsilon").c_str(), 1e-6f);
  gguf_set_val_u32(g, key("expert_count").c_str(), kExperts);
  gguf_set_val_u32(g, key("expert_used_count").c_str(), kTopK);
  gguf_set_val_u32(g, key("expert_shared_count").c_str(), 1);
  gguf_set_val_f32(g, key("expert_weights_scale").c_str(), 2.0f);
  gguf_set_val_bool(g, key("expert_weights_norm").c_str(), true);
  gguf_set_val_u32(g, key("expert_gating_func").c_str(), 2);  // sigmoid
  gguf_set_val_u32(g, key("leading_dense_block_count").c_str(), 0);
  gguf_set_val_u32(g, key("attention.indexer.head_count").c_str(), kIndexHeads);
  gguf_set_val_u32(g, key("attention.indexer.key_length").c_str(), kIndexDim);
  gguf_set_val_u32(g, key("attention.indexer.top_k").c_str(), kTopkBlocks);
  gguf_set_val_u32(g, key("attention.indexer.block_size").c_str(), kBlock);
  gguf_set_val_u32(g, key("attention.indexer.local_blocks").c_str(), kLocalBlocks);

  ggml_init_params ip{ggml_tensor_overhead() * (plan.size() + 8), nullptr, true};
  ggml_context* meta = ggml_init(ip);
  for (const TensorPlan& t : plan) {
    ggml_tensor* x = ggml_new_tensor(meta, t.type, static_cast<int>(t.ne.size()), t.ne.data());
    ggml_set_name(x, t.name.c_str());
    gguf_add_tensor(g, x);
  }
  uint64_t need = gguf_get_meta_size(g);
  for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) need += gguf_get_tensor_size(g, i) + 32;
  const std::string partial = out + ".partial";
  {
    std::string folder = out.find('/') == std::string::npos ? "." : out.substr(0, out.rfind('/'));
    struct statvfs vfs;
    if (statvfs(folder.c_str(), &vfs) == 0 && static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize < need)
      Die("the GGUF needs " + std::to_string(need >> 20) + " MiB but " + folder + " has only " +
          std::to_string((static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize) >> 20) + " MiB free");
  }
  FILE* f = std::fopen(partial.c_str(), "wb");
  if (!f) Die("cannot write " + partial);
  if (!gguf_write_to_file_ptr(g, f, /*only_meta=*/true)) Die("cannot write the GGUF header");
  const size_t data0 = gguf_get_meta_size(g);
  if (static_cast<size_t>(std::ftell(f)) != data0) Die("GGUF header size differs from its data offset");
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  uint64_t total = 0;
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
    const size_t at = data0 + gguf_get_tensor_offset(g, i);
    static const uint8_t zeros[64] = {};
    for (long pos = std::ftell(f); static_cast<size_t>(pos) < at; ++pos) std::fwrite(zeros, 1, 1, f);  // alignment
    WriteTensor(f, plan[static_cast<size_t>(i)], Mix64(0x6D33'7065'6572ull + static_cast<uint64_t>(i)), threads);
    total += gguf_get_tensor_size(g, i);
  }
  if (std::fclose(f) != 0) Die("cannot finish " + partial);
  if (std::rename(partial.c_str(), out.c_str()) != 0) Die("cannot rename " + partial);
  std::fprintf(stderr, "llama_peer: wrote %s (%d layers, %s, %.2f GB of tensors) in %.1f s\n", out.c_str(), layers,
               type.c_str(), static_cast<double>(total) / 1e9, Seconds(t0, Clock::now()));
  gguf_free(g);
  ggml_free(meta);
  return 0;
}

// ---- bench -------------------------------------------------------------------------------------

// Layer ends inside a pass, as m3 bench's LayerClock times them: while `on`, the scheduler is
// asked for each layer's output ("l_out-<layer>"), which ends a graph split there, and the time
// it is ready is kept. The time between two ends is a layer's (the first includes the embedding
// lookup); what follows the last end is the final norm, lm_head and the caller's argmax.
struct LayerEnds {
  bool on = false;
  Clock::time_point start;
  std::vector<Clock::time_point> end;
  void Start(int layers) {
    end.assign(static_cast<size_t>(layers), Clock::time_point{});
    start = Clock::now();
  }
  std::vector<double> LayerSeconds() const {
    std::vector<double> v;
    for (size_t l = 0; l < end.size(); ++l) v.push_back(Seconds(l == 0 ? start : end[l - 1], end[l]));
    return v;
  }
};

int LayerOf(const char* name) {  // "l_out-<layer>", else -1
  if (std::strncmp(name, "l_out-", 6) != 0) return -1;
  char* rest = nullptr;
  const long l = std::strtol(name + 6, &rest, 10);
  return rest != name + 6 && *rest == 0 ? static_cast<int>(l) : -1;
}

bool OnTensor(ggml_tensor* t, bool ask, void* user) {
  auto* s = static_cast<LayerEnds*>(user);
  const int layer = LayerOf(t->name);
  if (ask) return s->on && layer >= 0;
  if (layer >= 0 && static_cast<size_t>(layer) < s->end.size()) s->end[static_cast<size_t>(layer)] = Clock::now();
  return true;
}

double Mean(const std::vector<double>& v, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) sum += v[i];
  return end > begin ? sum / static_cast<double>(end - begin) : 0;
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

void QuietLog(ggml_log_level level, const char* text, void*) {
  if (level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
}

// Brings the file into the page cache (as m3 bench reads its weights in before timing).
double ReadIn(const std::string& path) {
  const auto t0 = Clock::now();
  const int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) Die("cannot open " + path);
  std::vector<char> buf(size_t{8} << 20);
  while (read(fd, buf.data(), buf.size()) > 0) {
  }
  close(fd);
  return Seconds(t0, Clock::now());
}

int Bench(const std::string& model_path, const std::string& libs, int threads, int prompt, int decode, int split_steps,
          bool verbose, bool no_repack) {
  if (threads < 1 || prompt < 1 || decode < 1 || split_steps < 0) Die("-t, -p, -n must be >= 1");
  if (!verbose) llama_log_set(QuietLog, nullptr);
  ggml_backend_load_all_from_path(libs.c_str());
  llama_backend_init();
  const double read_in_s = ReadIn(model_path);

  auto t0 = Clock::now();
  llama_model_params mp = llama_model_default_params();
  if (no_repack) mp.use_extra_bufts = false;
  llama_model* model = llama_model_load_from_file(model_path.c_str(), mp);
  if (!model) Die("cannot load " + model_path);
  const double load_s = Seconds(t0, Clock::now());
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const int n_vocab = llama_vocab_n_tokens(vocab);

  LayerEnds ends;
  const int layers = std::max(1, static_cast<int>(llama_model_n_layer(model)));
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(prompt + decode + split_steps + 16);
  cp.n_batch = static_cast<uint32_t>(std::max(prompt, 512));
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  cp.n_seq_max = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  cp.cb_eval = OnTensor;
  cp.cb_eval_user_data = &ends;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) Die("cannot create a context");
  llama_memory_t mem = llama_get_memory(ctx);

  uint64_t s = 0x5EED;
  auto random_ids = [&](size_t n) {
    std::vector<llama_token> ids(n);
    for (auto& id : ids) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<llama_token>((s >> 33) % static_cast<uint64_t>(n_vocab));
    }
    return ids;
  };
  auto argmax = [&] {
    const float* logits = llama_get_logits_ith(ctx, -1);
    return static_cast<llama_token>(std::max_element(logits, logits + n_vocab) - logits);
  };
  // The last logits' sanity (as m3 bench reports it), untimed.
  bool logits_finite = true;
  double logits_rms = 0;
  auto check_logits = [&] {
    const float* logits = llama_get_logits_ith(ctx, -1);
    double ss = 0;
    for (int i = 0; i < n_vocab; ++i) {
      logits_finite = logits_finite && std::isfinite(logits[i]);
      ss += static_cast<double>(logits[i]) * logits[i];
    }
    logits_rms = std::sqrt(ss / n_vocab);
  };
  std::vector<llama_token> ids = random_ids(static_cast<size_t>(prompt));
  auto eval = [&](llama_token* p, int n) {
    if (llama_decode(ctx, llama_batch_get_one(p, n)) != 0) Die("llama_decode failed");
  };
  // Untimed: first-call allocations, graph building, page faults.
  eval(ids.data(), prompt);
  llama_token tok = argmax();
  for (int i = 0; i < 2; ++i, tok = argmax()) eval(&tok, 1);
  llama_memory_clear(mem, true);

  // Timed: up to three prefills from an empty cache while each takes under 10 s, the median is
  // the figure (as m3 bench takes it); the last one's cache stays for the decode. Their layers
  // are timed as they end (a split per layer: microseconds against a layer's prefill).
  std::vector<double> prefills, full_layer, last_layer, prefill_rest;
  for (;;) {
    ends.on = true;
    ends.Start(layers);
    t0 = Clock::now();
    eval(ids.data(), prompt);
    tok = argmax();
    const auto t1 = Clock::now();
    ends.on = false;
    prefills.push_back(Seconds(t0, t1));
    check_logits();
    const std::vector<double> ls = ends.LayerSeconds();
    if (layers > 1) full_layer.push_back(Mean(ls, 0, ls.size() - 1));
    last_layer.push_back(ls.back());
    prefill_rest.push_back(Seconds(ends.end.back(), t1));
    if (prefills.size() == 3 || prefills.back() >= 10) break;
    llama_memory_clear(mem, true);
  }
  const double ttft = Median(prefills);
  // Decode: n steps as users run them (the tok/s), then --split-steps more timed layer by layer.
  std::vector<double> steps, layer_mean, rest;
  for (int i = 0; i < decode + split_steps; ++i) {
    ends.on = i >= decode;
    ends.Start(layers);
    t0 = Clock::now();
    eval(&tok, 1);
    tok = argmax();
    const auto t1 = Clock::now();
    check_logits();
    if (!ends.on) {
      steps.push_back(Seconds(t0, t1));
    } else {
      const std::vector<double> ls = ends.LayerSeconds();
      layer_mean.push_back(Mean(ls, 0, ls.size()));
      rest.push_back(Seconds(ends.end.back(), t1));
    }
  }
  ends.on = false;
  double total = 0;
  for (double v : steps) total += v;
  const double step = Median(steps), t_rest = Median(rest), t_layer = Median(layer_mean);
  const double t_layer_prefill = Median(full_layer), t_last_prefill = Median(last_layer),
               t_rest_prefill = Median(prefill_rest);
  char projected_prefill[32] = "null";  // needs a full layer (2+ layers)
  if (t_layer_prefill > 0)
    std::snprintf(projected_prefill, sizeof projected_prefill, "%.3f",
                  prompt / (59 * t_layer_prefill + t_last_prefill + t_rest_prefill));

  // Bytes a decode step reads: every tensor but the embedding table (one row of it) and the
  // routed experts (top-k of each layer's); the layers' part and the output norm + lm_head's.
  uint64_t fixed = 0, experts = 0, weights = 0, lm_head = 0, embed_row = 0;
  {
    gguf_init_params gp{true, nullptr};
    gguf_context* g = gguf_init_from_file(model_path.c_str(), gp);
    if (!g) Die("cannot read the GGUF header of " + model_path);
    for (int64_t i = 0; i < gguf_get_n_tensors(g); ++i) {
      const std::string name = gguf_get_tensor_name(g, i);
      const uint64_t bytes = gguf_get_tensor_size(g, i);
      weights += bytes;
      if (name == "token_embd.weight") embed_row = bytes / static_cast<uint64_t>(n_vocab);
      else if (name.find("_exps.") != std::string::npos) experts += bytes / kExperts * kTopK;
      else if (name == "output.weight" || name == "output_norm.weight") lm_head += bytes;
      else fixed += bytes;
    }
    gguf_free(g);
  }
  const double bytes_per_token = static_cast<double>(fixed + experts + lm_head + embed_row);
  const double layer_bytes = static_cast<double>(fixed + experts) / layers;

  std::printf(
      "{\"engine\": \"llama.cpp\", \"system_info\": \"%s\", \"model\": \"%s\", \"layers\": %d, \"threads\": %d, "
      "\"prompt_tokens\": %d, \"decode_tokens\": %d, \"flash_attn\": true, \"mmap\": true, \"repack\": %s, "
      "\"read_in_s\": %.3f, \"load_s\": %.3f, \"weight_bytes\": %llu, \"bytes_per_token\": %.0f, "
      "\"layer_bytes_per_token\": %.0f, \"lm_head_bytes\": %llu, \"ttft_s\": %.6f, \"prefill_runs\": %zu, "
      "\"prefill_tok_s\": %.3f, \"t_layer_prefill_s\": %.6f, \"t_last_layer_prefill_s\": %.6f, "
      "\"t_rest_prefill_s\": %.6f, \"decode_step_s_median\": %.6f, \"decode_tok_s\": %.4f, "
      "\"decode_tok_s_mean\": %.4f, \"decode_gbps\": %.3f, \"split_steps\": %d, \"t_layer_s\": %.6f, "
      "\"t_rest_s\": %.6f, \"projected_full_model_tok_s\": %.4f, \"projected_full_model_prefill_tok_s\": %s, "
      "\"logits_finite\": %s, \"logits_rms\": %.4g}\n",
      llama_print_system_info(), model_path.c_str(), layers, threads, prompt, decode, no_repack ? "false" : "true",
      read_in_s, load_s, static_cast<unsigned long long>(weights), bytes_per_token, layer_bytes,
      static_cast<unsigned long long>(lm_head), ttft, prefills.size(), prompt / ttft, t_layer_prefill,
      t_last_prefill, t_rest_prefill, step, 1.0 / step, decode / total, bytes_per_token / step / 1e9, split_steps,
      t_layer, t_rest, 1.0 / (60 * t_layer + t_rest), projected_prefill, logits_finite ? "true" : "false",
      logits_rms);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

std::vector<llama_token> ParseIds(const std::string& list) {
  std::vector<llama_token> ids;
  size_t i = 0;
  while (i < list.size()) {
    size_t end = list.find(',', i);
    if (end == std::string::npos) end = list.size();
    const std::string v = list.substr(i, end - i);
    char* stop = nullptr;
    const long id = std::strtol(v.c_str(), &stop, 10);
    if (v.empty() || *stop || id < 0 || id > INT32_MAX) Die("--ids: not a token id: " + v);
    ids.push_back(static_cast<llama_token>(id));
    i = end + 1;
  }
  if (ids.empty()) Die("--ids: no ids");
  return ids;
}

int Greedy(const std::string& model_path, const std::string& libs, int threads, const std::string& id_list,
           int steps, bool verbose) {
  if (!verbose) llama_log_set(QuietLog, nullptr);
  ggml_backend_load_all_from_path(libs.c_str());
  llama_backend_init();
  llama_model* model = llama_model_load_from_file(model_path.c_str(), llama_model_default_params());
  if (!model) Die("cannot load " + model_path);
  const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::vector<llama_token> ids = ParseIds(id_list);
  for (llama_token id : ids)
    if (id >= n_vocab) Die("--ids: " + std::to_string(id) + " is past the vocabulary");
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = static_cast<uint32_t>(ids.size() + steps + 16);
  cp.n_batch = cp.n_ubatch = static_cast<uint32_t>(ids.size());
  cp.n_threads = cp.n_threads_batch = threads;
  cp.n_seq_max = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (!ctx) Die("cannot create a context");
  auto eval = [&](llama_token* p, int n) {
    if (llama_decode(ctx, llama_batch_get_one(p, n)) != 0) Die("llama_decode failed");
  };
  auto argmax = [&] {
    const float* logits = llama_get_logits_ith(ctx, -1);
    return static_cast<llama_token>(std::max_element(logits, logits + n_vocab) - logits);
  };
  eval(ids.data(), static_cast<int>(ids.size()));
  const float* last = llama_get_logits_ith(ctx, -1);
  std::string logits = "[";
  for (int i = 0; i < n_vocab; ++i) {
    char v[32];
    std::snprintf(v, sizeof v, "%s%.9g", i ? ", " : "", static_cast<double>(last[i]));
    logits += v;
  }
  logits += "]";
  std::vector<llama_token> greedy{argmax()};
  for (int i = 0; i < steps; ++i) {
    llama_token t = greedy.back();
    eval(&t, 1);
    greedy.push_back(argmax());
  }
  std::string out = "[";
  for (size_t i = 0; i < greedy.size(); ++i) out += (i ? ", " : "") + std::to_string(greedy[i]);
  std::printf("{\"engine\": \"llama.cpp\", \"model\": \"%s\", \"prompt_tokens\": %zu, \"greedy_ids\": %s], "
              "\"last_prefill_logits\": %s}\n",
              model_path.c_str(), ids.size(), out.c_str(), logits.c_str());
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) Die("usage: llama_peer gen|bench|greedy [options] (see the head of llama_peer.cc)");
  const std::string cmd = argv[1];
  std::string out, model, libs, type = "q4-mixed", ids;
  int layers = 1, threads = 1, prompt = 512, decode = 64, split_steps = 16;
  bool verbose = false, no_repack = false;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) Die(a + " needs a value");
      return argv[++i];
    };
    auto number = [&]() {
      const std::string v = value();
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 0 || n > 1 << 24) Die(a + ": not a count: " + v);
      return static_cast<int>(n);
    };
    if (a == "--out") out = value();
    else if (a == "--layers") layers = number();
    else if (a == "--type") type = value();
    else if (a == "--ids") ids = value();
    else if (a == "--model") model = value();
    else if (a == "--libs") libs = value();
    else if (a == "-t") threads = number();
    else if (a == "-p") prompt = number();
    else if (a == "-n") decode = number();
    else if (a == "--split-steps") split_steps = number();
    else if (a == "-v") verbose = true;
    else if (a == "--no-repack") no_repack = true;
    else Die("unknown option " + a);
  }
  if (cmd == "gen") {
    if (out.empty()) Die("gen needs --out FILE.gguf");
    return Gen(out, layers, type);
  }
  if (cmd == "bench") {
    if (model.empty() || libs.empty()) Die("bench needs --model FILE.gguf and --libs DIR");
    return Bench(model, libs, threads, prompt, decode, split_steps, verbose, no_repack);
  }
  if (cmd == "greedy") {
    if (model.empty() || libs.empty() || ids.empty()) Die("greedy needs --model FILE.gguf, --libs DIR and --ids LIST");
    return Greedy(model, libs, threads, ids, decode, verbose);
  }
  Die("unknown command " + cmd + " (gen, bench or greedy)");
}
