// The prompt chunk chosen for a model on a machine (runtime/prefill_chunk.h) and how sessions use it.
#include <string>

#include "runtime/engine.h"
#include "runtime/prefill_chunk.h"
#include "test_util.h"

using namespace m3;

namespace {

// The full model at q4-mixed on a 16-core server: 255 GB a pass, ~114 GOP a token, ~0.5 MB of
// activations a token.
ChunkInputs FullModel(double read_gbps, double compute_gops, uint64_t memory) {
  ChunkInputs in;
  in.pass_weight_bytes = 255e9;
  in.ops_per_token = 114e9;
  in.activation_bytes_per_token = 0.5e6;
  in.read_gbps = read_gbps;
  in.compute_gops = compute_gops;
  in.memory_available = memory;
  return in;
}

}  // namespace

TEST_CASE("the prompt chunk amortizes the weights' read over the pass's compute", "[chunk]") {
  constexpr uint64_t kLots = uint64_t{1} << 40;
  SECTION("unknown rates: the default") {
    const ChunkChoice c = ChoosePrefillChunk(FullModel(0, 0, kLots), 2048);
    CHECK(c.tokens == 2048);
    CHECK(c.why.find("unknown") != std::string::npos);
  }
  SECTION("compute-bound machines keep the default") {
    // 2 cores: ~0.2 TOP/s against 20 GB/s: a token's 0.57 s dwarfs the 12.8 s read.
    const ChunkChoice c = ChoosePrefillChunk(FullModel(20, 200, kLots), 2048);
    CHECK(c.tokens == 2048);
    CHECK(c.read_floor_s / c.compute_s <= kMaxReadShare);
  }
  SECTION("fast compute against the read takes larger chunks, at most kMaxPrefillChunk") {
    // 100 GB/s, 40 TOP/s: the read is 2.55 s, a token 2.85 ms: 1/8 needs 7158 -> 7168 tokens.
    const ChunkChoice c = ChoosePrefillChunk(FullModel(100, 40000, kLots), 2048);
    CHECK(c.tokens == 7168);
    CHECK(c.tokens % kPrefillChunkStep == 0);
    CHECK(c.read_floor_s / c.compute_s <= kMaxReadShare);
    CHECK(c.read_floor_s / c.compute_s > kMaxReadShare * (c.tokens - kPrefillChunkStep) / c.tokens);
    CHECK(ChoosePrefillChunk(FullModel(10, 1e6, kLots), 2048).tokens == kMaxPrefillChunk);
  }
  SECTION("memory caps it, never below one step") {
    // 8 GB left: an eighth for activations of 0.5 MB a token is 2000 tokens -> 1536.
    const ChunkChoice c = ChoosePrefillChunk(FullModel(100, 40000, 8'000'000'000), 2048);
    CHECK(c.tokens == 1536);
    CHECK(c.why.find("memory") != std::string::npos);
    CHECK(ChoosePrefillChunk(FullModel(100, 40000, 1'000'000), 2048).tokens == kPrefillChunkStep);
  }
}

TEST_CASE("sessions take the engine's chunk for long prompts only, and a given one always", "[chunk]") {
  const std::string dir = test::GoldenDir("s2_bf16_sharded_init1");
  auto engine = Engine::Open(dir, EngineOptions{2});
  REQUIRE(engine.ok());
  const ChunkInputs in = ModelChunkInputs((*engine)->model());
  CHECK(in.pass_weight_bytes > 0);
  CHECK(in.ops_per_token > 0);
  CHECK(in.activation_bytes_per_token > 0);
  Session auto_chunk(**engine);
  CHECK(auto_chunk.ChunkFor(100) == kDefaultPrefillChunk);
  CHECK(auto_chunk.ChunkFor(kDefaultPrefillChunk) == kDefaultPrefillChunk);
  const ChunkChoice& choice = (*engine)->PromptChunk();
  CHECK(auto_chunk.ChunkFor(kDefaultPrefillChunk + 1) == choice.tokens);
  CHECK(choice.tokens % kPrefillChunkStep == 0);
  CHECK(choice.tokens <= kMaxPrefillChunk);
  CHECK(choice.read_floor_s > 0);  // this machine's rates were measured
  CHECK(choice.compute_s > 0);
  INFO(choice.why);
  CHECK(&(*engine)->PromptChunk() == &choice);  // measured once
  SessionOptions given;
  given.prefill_chunk = 7;
  Session seven(**engine, given);
  CHECK(seven.ChunkFor(3) == 7);
  CHECK(seven.ChunkFor(100000) == 7);
}
