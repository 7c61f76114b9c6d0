// One-off generator of tests/data/gguf/ggml_reference.gguf: ground truth from llama.cpp's own ggml
// library for the GGUF reader and the block dequantization of lib/format/gguf.h (tests/test_gguf.cc).
// Not part of the CMake build; the fixture it writes is committed.
//
// The file is written by ggml's GGUF writer (gguf_write_to_file), so it also checks our reader
// against a real writer. It holds:
//  - per type T of F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K:
//    tensor "<t>" [512, 2] of type T, two deterministic rows quantized by ggml_quantize_chunk (no
//    importance matrix), and tensor "<t>.ggml_f32" [512, 2] F32, ggml's own dequantization of it
//    (ggml_get_type_traits(T)->to_float);
//  - metadata of every GGUF value type (keys "fixture.*", the values tests/test_gguf.cc expects);
//  - ggml's type table for every id below GGML_TYPE_COUNT: "ggml.type_name" [string],
//    "ggml.block_size" [i64], "ggml.type_size" [u64] (0 / "DEPRECATED" for removed ids).
//
// Built and run against the prebuilt library of the llama.cpp peer (node-llama-cpp 3.22.1,
// llama.cpp tag v0.5.0), from the repository root:
//
//   P=~/.cache/m3/peer/node-llama-cpp-3.22.1
//   g++ -std=c++17 -O1 -I$P/include tests/data/gguf/make_fixture.cc -L$P/bins/linux-x64 -lggml-base -Wl,-rpath,$P/bins/linux-x64 -o /tmp/make_gguf_fixture
//   /tmp/make_gguf_fixture tests/data/gguf/ggml_reference.gguf
//
// The rows depend only on integer arithmetic and IEEE basic operations (no libm), so the input
// is the same everywhere; the output is whatever that ggml build computes on x86-64.
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "ggml.h"
#include "gguf.h"

namespace {

constexpr int kRowElements = 512;
constexpr int kRows = 2;

// splitmix64: a fixed sequence of 64-bit values.
struct Sequence {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 bits.
  float Uniform() { return static_cast<float>(Next() >> 40) * (1.0f / 16777216.0f); }
  // Gaussian-ish: the sum of four uniforms, centred and scaled to unit variance (Irwin-Hall), with
  // only +, - and * (no libm, so the same bits on every machine).
  float Gaussian() {
    float s = Uniform() + Uniform() + Uniform() + Uniform();
    return (s - 2.0f) * 1.7320508f;
  }
};

// Row 0: Gaussian-ish values. Row 1: blocks of the cases a quantizer treats specially.
std::vector<float> MakeRows() {
  std::vector<float> x(kRows * kRowElements);
  Sequence seq{20260401};
  for (int i = 0; i < kRowElements; ++i) x[i] = seq.Gaussian();
  float* r = x.data() + kRowElements;
  for (int i = 0; i < 32; ++i) r[i] = 0.0f;                                   // an all-zero block
  for (int i = 32; i < 64; ++i) r[i] = 0.75f;                                 // a constant block
  for (int i = 64; i < 96; ++i) r[i] = 0.01f * seq.Gaussian();                // small values ...
  r[77] = 6.0e4f;                                                              // ... and one near fp16's max
  for (int i = 96; i < 128; ++i) r[i] = 1.0e-6f * seq.Gaussian();             // fp16-subnormal scales
  for (int i = 128; i < 160; ++i) r[i] = -1.0f - seq.Uniform();               // negative only (mins)
  for (int i = 160; i < 192; ++i) r[i] = 2.0f + seq.Uniform();                // positive only
  for (int i = 192; i < 256; ++i) r[i] = static_cast<float>(i - 224) / 32.0f;  // a ramp
  for (int i = 256; i < 288; ++i) r[i] = (i % 2 ? -1.0f : 1.0f) * 3.0e4f;     // alternating extremes
  for (int i = 288; i < 320; ++i) r[i] = -65504.0f * seq.Uniform();
  for (int i = 320; i < 384; ++i) r[i] = 1.0e-3f * seq.Gaussian();
  for (int i = 384; i < 448; ++i) r[i] = 0.0f;
  r[400] = -2.5f;                                                              // a lone value
  for (int i = 448; i < 512; ++i) r[i] = 100.0f * seq.Gaussian();
  return x;
}

struct TypeCase {
  ggml_type type;
  const char* name;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s OUT.gguf\n", argv[0]);
    return 2;
  }
  const TypeCase cases[] = {{GGML_TYPE_F16, "f16"},   {GGML_TYPE_BF16, "bf16"}, {GGML_TYPE_Q8_0, "q8_0"},
                            {GGML_TYPE_Q4_0, "q4_0"}, {GGML_TYPE_Q4_1, "q4_1"}, {GGML_TYPE_Q5_0, "q5_0"},
                            {GGML_TYPE_Q5_1, "q5_1"}, {GGML_TYPE_Q2_K, "q2_k"}, {GGML_TYPE_Q3_K, "q3_k"},
                            {GGML_TYPE_Q4_K, "q4_k"}, {GGML_TYPE_Q5_K, "q5_k"}, {GGML_TYPE_Q6_K, "q6_k"}};
  const std::vector<float> rows = MakeRows();

  ggml_init_params params = {64u << 20, nullptr, false};
  ggml_context* ctx = ggml_init(params);
  gguf_context* gguf = gguf_init_empty();

  // Metadata of every value type; tests/test_gguf.cc expects exactly these.
  gguf_set_val_u8(gguf, "fixture.u8", 200);
  gguf_set_val_i8(gguf, "fixture.i8", -100);
  gguf_set_val_u16(gguf, "fixture.u16", 60000);
  gguf_set_val_i16(gguf, "fixture.i16", -30000);
  gguf_set_val_u32(gguf, "fixture.u32", 4000000000u);
  gguf_set_val_i32(gguf, "fixture.i32", -2000000000);
  gguf_set_val_f32(gguf, "fixture.f32", 0.1f);
  gguf_set_val_bool(gguf, "fixture.bool", true);
  gguf_set_val_str(gguf, "fixture.string", "minimax-m3 \xc3\xa9\xe2\x9c\x93");
  gguf_set_val_u64(gguf, "fixture.u64", 18000000000000000000ull);
  gguf_set_val_i64(gguf, "fixture.i64", -9000000000000000000ll);
  gguf_set_val_f64(gguf, "fixture.f64", 1e300);
  const int32_t i32s[] = {1, -2, 3, 2147483647};
  gguf_set_arr_data(gguf, "fixture.i32s", GGUF_TYPE_INT32, i32s, 4);
  const float f32s[] = {0.5f, -1.25f, 1e-30f};
  gguf_set_arr_data(gguf, "fixture.f32s", GGUF_TYPE_FLOAT32, f32s, 3);
  const uint8_t u8s[] = {0, 255};
  gguf_set_arr_data(gguf, "fixture.u8s", GGUF_TYPE_UINT8, u8s, 2);
  const char* strings[] = {"<s>", "", "\xc4\xa0the", "a b"};
  gguf_set_arr_str(gguf, "fixture.strings", strings, 4);

  // ggml's type table, for every id it has.
  std::vector<std::string> type_names;
  std::vector<const char*> type_name_ptrs;
  std::vector<int64_t> block_sizes;
  std::vector<uint64_t> type_sizes;
  for (int id = 0; id < GGML_TYPE_COUNT; ++id) {
    const ggml_type_traits* t = ggml_get_type_traits(static_cast<ggml_type>(id));
    type_names.push_back(t->type_name ? t->type_name : "");
    block_sizes.push_back(t->blck_size);
    type_sizes.push_back(t->type_size);
  }
  for (const auto& n : type_names) type_name_ptrs.push_back(n.c_str());
  gguf_set_arr_str(gguf, "ggml.type_name", type_name_ptrs.data(), type_name_ptrs.size());
  gguf_set_arr_data(gguf, "ggml.block_size", GGUF_TYPE_INT64, block_sizes.data(), block_sizes.size());
  gguf_set_arr_data(gguf, "ggml.type_size", GGUF_TYPE_UINT64, type_sizes.data(), type_sizes.size());

  for (const TypeCase& c : cases) {
    ggml_tensor* q = ggml_new_tensor_2d(ctx, c.type, kRowElements, kRows);
    ggml_set_name(q, c.name);
    const size_t bytes = ggml_quantize_chunk(c.type, rows.data(), q->data, 0, kRows, kRowElements, nullptr);
    if (bytes != ggml_nbytes(q)) {
      std::fprintf(stderr, "%s: quantized %zu bytes, expected %zu\n", c.name, bytes, ggml_nbytes(q));
      return 1;
    }
    ggml_tensor* f = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, kRowElements, kRows);
    ggml_set_name(f, (std::string(c.name) + ".ggml_f32").c_str());
    ggml_get_type_traits(c.type)->to_float(q->data, static_cast<float*>(f->data), kRows * kRowElements);
    gguf_add_tensor(gguf, q);
    gguf_add_tensor(gguf, f);
  }

  if (!gguf_write_to_file(gguf, argv[1], false)) {
    std::fprintf(stderr, "could not write %s\n", argv[1]);
    return 1;
  }
  gguf_free(gguf);
  ggml_free(ctx);
  std::printf("wrote %s\n", argv[1]);
  return 0;
}
