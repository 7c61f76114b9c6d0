// The GGUF reader and ggml block dequantization (lib/format/gguf.h): files written by
// tests/gguf_writer.h read back exactly; every kind of damage gives an error naming the file and
// the problem (never a crash); split sets open from any shard and refuse missing or foreign ones;
// dequantization gives ggml's own floats bit for bit (tests/data/gguf/ggml_reference.gguf, made by
// tests/data/gguf/make_fixture.cc with llama.cpp's ggml).
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "base/status.h"
#include "format/gguf.h"
#include "gguf_writer.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using m3::GgmlType;
using m3::GgufFile;
using m3::GgufShardSet;
using m3::GgufValueType;
using m3::StatusCode;
using m3::test::RequireError;
using m3::test::GgufWriter;
using m3::test::ReadBytes;
using m3::test::TempDir;
using m3::test::WriteBytes;
namespace w = m3::test;


template <class T>
const T& RequireOk(const m3::StatusOr<T>& r) {
  INFO(r.status().message());
  REQUIRE(r.ok());
  return *r;
}

void RequireOk(const m3::Status& s) {
  INFO(s.message());
  REQUIRE(s.ok());
}

uint32_t Id(GgmlType t) { return static_cast<uint32_t>(t); }

// n bytes of a deterministic pattern (tensor contents whose every byte is checked on read).
std::string Pattern(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 8)) & 0xFF);
  return s;
}

std::string F32Bytes(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

// A small file with a bit of everything: metadata of several types and four tensors.
GgufWriter SmallModel() {
  GgufWriter g;
  g.SetString("general.architecture", "minimax-m3")
      .SetU32("minimax-m3.block_count", 2)
      .SetF32("minimax-m3.rope.freq_base", 10000.0f)
      .SetStringArray("tokenizer.ggml.tokens", {"a", "b", "<s>"})
      .SetArray<int32_t>("tokenizer.ggml.token_type", w::kGgufI32, {1, 1, 3});
  g.AddTensor("token_embd.weight", Id(GgmlType::kF32), {4, 3}, F32Bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}));
  g.AddTensor("blk.0.attn_q.weight", Id(GgmlType::kQ8_0), {64, 2}, Pattern(4 * 34, 1));
  g.AddTensor("blk.0.ffn_down.weight", Id(GgmlType::kQ4_K), {256, 1}, Pattern(144, 2));
  g.AddTensor("output_norm.weight", Id(GgmlType::kBF16), {5}, Pattern(10, 3));
  return g;
}

// Writes `bytes` to DIR/name and opens it.
m3::StatusOr<std::unique_ptr<GgufFile>> OpenBytes(const TempDir& dir, const std::string& bytes,
                                                  const std::string& name = "x.gguf") {
  WriteBytes(dir.path() / name, bytes);
  return GgufFile::Open((dir.path() / name).string());
}

template <class T>
std::string Le(T v) {
  return GgufWriter::Pod(v);
}

// `bytes` with the value at `at` replaced by `v`.
template <class T>
std::string Patch(std::string bytes, size_t at, T v) {
  std::memcpy(bytes.data() + at, &v, sizeof(T));
  return bytes;
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Round trips.

TEST_CASE("GGUF metadata of every value type reads back through the typed getters", "[gguf]") {
  TempDir dir;
  GgufWriter g;
  g.version = 2;  // v2 and v3 share the layout
  g.SetU8("u8", 250).SetI8("i8", -120).SetU16("u16", 65000).SetI16("i16", -32000).SetU32("u32", 4000000000u)
      .SetI32("i32", -2000000000).SetF32("f32", 0.25f).SetBool("yes", true).SetBool("no", false)
      .SetString("str", "h\xc3\xa9llo").SetString("empty", "").SetU64("u64", 1ull << 62).SetI64("i64", -(1ll << 62))
      .SetF64("f64", -1e300).SetU64("u64.huge", 1ull << 63)
      .SetArray<uint8_t>("arr.u8", w::kGgufU8, {1, 2, 255}).SetArray<int16_t>("arr.i16", w::kGgufI16, {-5, 7})
      .SetArray<uint64_t>("arr.u64", w::kGgufU64, {1ull << 63}).SetArray<float>("arr.f32", w::kGgufF32, {0.5f, -2.0f})
      .SetArray<double>("arr.f64", w::kGgufF64, {1e-300}).SetArray<uint8_t>("arr.bool", w::kGgufBool, {1, 0})
      .SetArray<int32_t>("arr.empty", w::kGgufI32, {})
      .SetStringArray("arr.str", {"<s>", "", "\xc4\xa0the"})
      // An array of two arrays (one level of nesting): kept, readable by no getter.
      .SetRaw("arr.nested", w::kGgufArray,
              GgufWriter::ArrayValue(w::kGgufArray, 2,
                                     GgufWriter::ArrayValue(w::kGgufI32, 1, Le<int32_t>(7)) +
                                         GgufWriter::ArrayValue(w::kGgufString, 1, GgufWriter::String("x"))));
  auto file = OpenBytes(dir, g.Bytes());
  RequireOk(file);
  const m3::GgufMetadata& m = (*file)->metadata();
  CHECK((*file)->version() == 2);
  CHECK((*file)->tensors().empty());
  CHECK(m.entries().size() == 24);
  CHECK(m.entries()[0].key == "u8");
  CHECK(m.entries()[23].key == "arr.nested");

  CHECK(RequireOk(m.GetInt("u8")) == 250);
  CHECK(RequireOk(m.GetInt("i8")) == -120);
  CHECK(RequireOk(m.GetInt("u16")) == 65000);
  CHECK(RequireOk(m.GetInt("i16")) == -32000);
  CHECK(RequireOk(m.GetInt("u32")) == 4000000000ll);
  CHECK(RequireOk(m.GetInt("i32")) == -2000000000);
  CHECK(RequireOk(m.GetInt("u64")) == (1ll << 62));
  CHECK(RequireOk(m.GetInt("i64")) == -(1ll << 62));
  CHECK(RequireOk(m.GetFloat("f32")) == 0.25);
  CHECK(RequireOk(m.GetFloat("f64")) == -1e300);
  CHECK(RequireOk(m.GetBool("yes")));
  CHECK_FALSE(RequireOk(m.GetBool("no")));
  CHECK(RequireOk(m.GetString("str")) == "h\xc3\xa9llo");
  CHECK(RequireOk(m.GetString("empty")).empty());
  CHECK(RequireOk(m.GetIntArray("arr.u8")) == std::vector<int64_t>{1, 2, 255});
  CHECK(RequireOk(m.GetIntArray("arr.i16")) == std::vector<int64_t>{-5, 7});
  CHECK(RequireOk(m.GetIntArray("arr.empty")).empty());
  CHECK(RequireOk(m.GetNumberArray("arr.f32")) == std::vector<double>{0.5, -2.0});
  CHECK(RequireOk(m.GetNumberArray("arr.f64")) == std::vector<double>{1e-300});
  CHECK(RequireOk(m.GetNumberArray("arr.i16")) == std::vector<double>{-5, 7});
  CHECK(RequireOk(m.GetNumberArray("arr.u64")) == std::vector<double>{9223372036854775808.0});
  CHECK(RequireOk(m.GetStringArray("arr.str")) == std::vector<std::string_view>{"<s>", "", "\xc4\xa0the"});

  const m3::GgufKeyValue* nested = m.Find("arr.nested");
  REQUIRE(nested);
  CHECK(nested->type == GgufValueType::kArray);
  CHECK(nested->element_type == GgufValueType::kArray);
  CHECK(nested->count == 2);
  CHECK(nested->value_bytes == 2 * 12 + 4 + 8 + 1);
  const m3::GgufKeyValue* str = m.Find("arr.str");
  REQUIRE(str);
  CHECK(str->element_type == GgufValueType::kString);
  CHECK(str->count == 3);
  CHECK(m.Find("absent") == nullptr);
  CHECK_FALSE(m.Has("absent"));
}

TEST_CASE("GGUF metadata getters name the key and the types when they refuse", "[gguf]") {
  TempDir dir;
  GgufWriter g;
  g.SetU32("n", 7).SetString("s", "x").SetU64("huge", 1ull << 63).SetArray<uint64_t>("huge.arr", w::kGgufU64, {1, 1ull << 63})
      .SetStringArray("strs", {"a"}).SetArray<float>("floats", w::kGgufF32, {1.0f}).SetBool("b", true)
      .SetRaw("nested", w::kGgufArray, GgufWriter::ArrayValue(w::kGgufArray, 1, GgufWriter::ArrayValue(w::kGgufU8, 0, "")));
  auto file = OpenBytes(dir, g.Bytes());
  RequireOk(file);
  const std::string path = (dir.path() / "x.gguf").string();
  const m3::GgufMetadata& m = (*file)->metadata();
  CHECK(m.path() == path);
  RequireError(m.GetInt("absent.key"), StatusCode::kNotFound, {path, "'absent.key'", "missing"});
  RequireError(m.GetString("n"), StatusCode::kCorrupt, {path, "'n'", "u32", "not a string"});
  RequireError(m.GetInt("s"), StatusCode::kCorrupt, {"'s'", "string", "not an integer"});
  RequireError(m.GetFloat("n"), StatusCode::kCorrupt, {"'n'", "u32", "not a float"});
  RequireError(m.GetBool("n"), StatusCode::kCorrupt, {"'n'", "not a bool"});
  RequireError(m.GetInt("b"), StatusCode::kCorrupt, {"'b'", "bool"});
  RequireError(m.GetInt("huge"), StatusCode::kOutOfRange, {"'huge'", "9223372036854775808", "int64"});
  RequireError(m.GetIntArray("huge.arr"), StatusCode::kOutOfRange, {"'huge.arr'", "element 1"});
  RequireError(m.GetIntArray("strs"), StatusCode::kCorrupt, {"'strs'", "array of string", "not an array of integers"});
  RequireError(m.GetIntArray("floats"), StatusCode::kCorrupt, {"'floats'", "array of f32"});
  RequireError(m.GetStringArray("floats"), StatusCode::kCorrupt, {"'floats'", "not an array of strings"});
  RequireError(m.GetNumberArray("strs"), StatusCode::kCorrupt, {"'strs'", "not an array of numbers"});
  RequireError(m.GetStringArray("s"), StatusCode::kCorrupt, {"'s'", "string, not an array"});
  RequireError(m.GetNumberArray("nested"), StatusCode::kCorrupt, {"'nested'", "array of array"});
  RequireError(m.GetString("nested"), StatusCode::kCorrupt, {"'nested'"});
}

TEST_CASE("GGUF tensors read back: shapes, types, offsets and bytes", "[gguf]") {
  TempDir dir;
  for (uint32_t alignment : {32u, 64u, 1u, 4096u}) {
    SECTION("alignment " + std::to_string(alignment)) {
      GgufWriter g = SmallModel();
      if (alignment != 32) g.SetAlignment(alignment);
      const std::string bytes = g.Bytes();
      auto file = OpenBytes(dir, bytes);
      RequireOk(file);
      const GgufFile& f = **file;
      CHECK(f.version() == 3);
      CHECK(f.alignment() == alignment);
      CHECK(f.data_offset() % alignment == 0);
      CHECK(RequireOk(f.metadata().GetString("general.architecture")) == "minimax-m3");
      REQUIRE(f.tensors().size() == 4);
      const std::vector<std::string> want = {F32Bytes({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}), Pattern(4 * 34, 1),
                                             Pattern(144, 2), Pattern(10, 3)};
      for (size_t i = 0; i < 4; ++i) {
        const m3::GgufTensorInfo& t = f.tensors()[i];
        INFO(t.name);
        CHECK(t.file == &f);
        CHECK(t.offset % alignment == 0);
        CHECK(t.data == f.file().data() + f.data_offset() + t.offset);
        REQUIRE(t.nbytes == want[i].size());
        CHECK(std::string(reinterpret_cast<const char*>(t.data), t.nbytes) == want[i]);
      }
      const m3::GgufTensorInfo& emb = f.tensors()[0];
      CHECK(emb.name == "token_embd.weight");
      CHECK(emb.type == GgmlType::kF32);
      CHECK(emb.n_dims == 2);
      CHECK(emb.ne == std::array<int64_t, 4>{4, 3, 1, 1});
      CHECK(emb.n_elements == 12);
      CHECK(emb.n_rows() == 3);
      CHECK(emb.row_bytes() == 16);
      CHECK(emb.ShapeString() == "[4, 3]");
      const m3::GgufTensorInfo& q = f.tensors()[1];
      CHECK(q.type == GgmlType::kQ8_0);
      CHECK(q.n_rows() == 2);
      CHECK(q.row_bytes() == 68);
      CHECK(f.tensors()[3].n_dims == 1);
      CHECK(f.tensors()[3].type == GgmlType::kBF16);

      // Rows decode from where they are: row 2 of the F32 tensor is 9..12.
      float row[4];
      RequireOk(m3::DequantizeGgufRows(emb, 2, 1, row));
      CHECK(std::vector<float>(row, row + 4) == std::vector<float>{9, 10, 11, 12});
      const m3::Status past = m3::DequantizeGgufRows(emb, 2, 2, row);
      CHECK(past.code() == StatusCode::kOutOfRange);
      CHECK_THAT(past.message(), Contains("x.gguf") && Contains("'token_embd.weight'") && Contains("[2, 4)"));
    }
  }
}

TEST_CASE("GGUF: an unknown-but-sized type is listed, and refused by name when decoded", "[gguf]") {
  TempDir dir;
  GgufWriter g;
  g.AddTensor("blk.0.ffn_up_exps.weight", Id(GgmlType::kIQ2_XXS), {256, 2}, Pattern(2 * 66, 5));
  g.AddTensor("blk.0.ffn_gate_exps.weight", Id(GgmlType::kMXFP4), {64, 1}, Pattern(2 * 17, 6));
  auto file = OpenBytes(dir, g.Bytes());
  RequireOk(file);
  const auto& t = (*file)->tensors();
  REQUIRE(t.size() == 2);
  CHECK(t[0].type == GgmlType::kIQ2_XXS);
  CHECK(std::string(m3::GgmlTypeName(t[0].type)) == "IQ2_XXS");
  CHECK(t[0].nbytes == 132);
  CHECK(t[1].nbytes == 34);
  std::vector<float> out(512);
  const m3::Status s = m3::DequantizeGgufRows(t[0], 0, 1, out.data());
  CHECK(s.code() == StatusCode::kUnsupported);
  CHECK_THAT(s.message(), Contains("'blk.0.ffn_up_exps.weight'") && Contains("IQ2_XXS") && Contains("x.gguf"));
}

// ----------------------------------------------------------------------------------------------
// Damage.

TEST_CASE("GGUF files truncated at every byte are refused until the data they need is there", "[gguf]") {
  TempDir dir;
  const std::string bytes = SmallModel().Bytes();
  auto whole = OpenBytes(dir, bytes, "whole.gguf");
  RequireOk(whole);
  size_t needed = 0;  // the end of the last tensor's data: the padding after it is optional
  for (const auto& t : (*whole)->tensors()) needed = std::max<size_t>(needed, t.data - (*whole)->file().data() + t.nbytes);
  REQUIRE(needed > bytes.size() - 32);
  const std::string path = (dir.path() / "x.gguf").string();
  for (size_t n = 0; n < bytes.size(); ++n) {
    INFO("truncated to " << n << " of " << bytes.size() << " bytes");
    auto file = OpenBytes(dir, bytes.substr(0, n));
    if (n < needed) {
      REQUIRE_FALSE(file.ok());
      const std::string& msg = file.status().message();
      INFO(msg);
      CHECK(file.status().code() == StatusCode::kCorrupt);
      CHECK_THAT(msg, Contains(path));
      CHECK((msg.find("truncated") != std::string::npos || msg.find("past the end of the file") != std::string::npos ||
             msg.find("cannot fit in the") != std::string::npos));
    } else {
      REQUIRE(file.ok());
      CHECK((*file)->tensors().size() == 4);
    }
  }
}

TEST_CASE("damaged GGUF headers and metadata are refused", "[gguf]") {
  TempDir dir;
  const std::string path = (dir.path() / "x.gguf").string();
  const std::string good = SmallModel().Bytes();
  RequireOk(OpenBytes(dir, good));

  SECTION("not GGUF") {
    RequireError(OpenBytes(dir, "PK\x03\x04 and the rest of a zip file"), StatusCode::kCorrupt,
                 {path, "not a GGUF file", "50 4b 03 04"});
    RequireError(OpenBytes(dir, ""), StatusCode::kCorrupt, {path, "truncated"});
    RequireError(OpenBytes(dir, "GGU"), StatusCode::kCorrupt, {path, "truncated"});
  }
  SECTION("versions") {
    RequireError(OpenBytes(dir, Patch<uint32_t>(good, GgufWriter::kVersionAt, 1)), StatusCode::kUnsupported,
                 {path, "version 1"});
    RequireError(OpenBytes(dir, Patch<uint32_t>(good, GgufWriter::kVersionAt, 0x03000000)), StatusCode::kUnsupported,
                 {path, "big-endian"});
    RequireError(OpenBytes(dir, Patch<uint32_t>(good, GgufWriter::kVersionAt, 4)), StatusCode::kUnsupported,
                 {path, "version 4"});
    RequireError(OpenBytes(dir, Patch<uint32_t>(good, GgufWriter::kVersionAt, 0)), StatusCode::kUnsupported,
                 {path, "version 0"});
  }
  SECTION("counts beyond the file") {
    RequireError(OpenBytes(dir, Patch<uint64_t>(good, GgufWriter::kKeyCountAt, 1ull << 60)), StatusCode::kCorrupt,
                 {path, "metadata key count 1152921504606846976", "cannot fit"});
    RequireError(OpenBytes(dir, Patch<uint64_t>(good, GgufWriter::kTensorCountAt, ~0ull)), StatusCode::kCorrupt,
                 {path, "tensor count 18446744073709551615", "cannot fit"});
    // One more tensor or key than written: the next read runs into the tensor data or off the end.
    CHECK_FALSE(OpenBytes(dir, Patch<uint64_t>(good, GgufWriter::kTensorCountAt, 5)).ok());
    CHECK_FALSE(OpenBytes(dir, Patch<uint64_t>(good, GgufWriter::kKeyCountAt, 6)).ok());
  }
  SECTION("string lengths beyond the file") {
    RequireError(OpenBytes(dir, Patch<uint64_t>(good, GgufWriter::kFirstKeyAt, 1ull << 62)), StatusCode::kCorrupt,
                 {path, "the key of metadata entry 0", "length 4611686018427387904", "runs past the end"});
    GgufWriter g;
    g.SetRaw("general.name", w::kGgufString, Le<uint64_t>(~0ull) + "abc");
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt, {path, "'general.name'", "runs past the end"});
    GgufWriter t;
    t.AddTensor("a", 0, {1}, "abcd");
    std::string bytes = t.Bytes();
    RequireError(OpenBytes(dir, Patch<uint64_t>(bytes, GgufWriter::kFirstKeyAt, 1ull << 40)), StatusCode::kCorrupt,
                 {path, "the name of tensor 0", "runs past the end"});
  }
  SECTION("array lengths beyond the file") {
    GgufWriter a;
    a.SetRaw("tokenizer.ggml.scores", w::kGgufArray, GgufWriter::ArrayValue(w::kGgufF32, 1ull << 61, ""));
    RequireError(OpenBytes(dir, a.Bytes()), StatusCode::kCorrupt, {path, "'tokenizer.ggml.scores'", "2305843009213693952 f32"});
    GgufWriter s;
    s.SetRaw("tokenizer.ggml.tokens", w::kGgufArray, GgufWriter::ArrayValue(w::kGgufString, ~0ull, GgufWriter::String("a")));
    RequireError(OpenBytes(dir, s.Bytes()), StatusCode::kCorrupt, {path, "'tokenizer.ggml.tokens'", "strings cannot fit"});
    GgufWriter s2;  // a plausible count, one string short
    s2.SetRaw("tokenizer.ggml.tokens", w::kGgufArray,
              GgufWriter::ArrayValue(w::kGgufString, 3, GgufWriter::String("abcdefghijkl") + GgufWriter::String("mnopqrstuvwx")));
    RequireError(OpenBytes(dir, s2.Bytes()), StatusCode::kCorrupt, {path, "'tokenizer.ggml.tokens'", "string 2"});
    GgufWriter n;
    n.SetRaw("nested", w::kGgufArray, GgufWriter::ArrayValue(w::kGgufArray, 1ull << 59, ""));
    RequireError(OpenBytes(dir, n.Bytes()), StatusCode::kCorrupt, {path, "'nested'", "inner arrays cannot fit"});
  }
  SECTION("unknown value types and deep nesting") {
    GgufWriter u;
    u.SetRaw("k", 13, Le<uint32_t>(0));
    RequireError(OpenBytes(dir, u.Bytes()), StatusCode::kCorrupt, {path, "'k'", "unknown value type 13"});
    GgufWriter e;
    e.SetRaw("k", w::kGgufArray, GgufWriter::ArrayValue(99, 0, ""));
    RequireError(OpenBytes(dir, e.Bytes()), StatusCode::kCorrupt, {path, "'k'", "unknown element type 99"});
    GgufWriter deep;
    deep.SetRaw("k", w::kGgufArray,
                GgufWriter::ArrayValue(w::kGgufArray, 1,
                                       GgufWriter::ArrayValue(w::kGgufArray, 1, GgufWriter::ArrayValue(w::kGgufU8, 0, ""))));
    RequireError(OpenBytes(dir, deep.Bytes()), StatusCode::kUnsupported, {path, "'k'", "nested more than one level"});
  }
  SECTION("duplicate keys") {
    GgufWriter g = SmallModel();
    g.SetU32("minimax-m3.block_count", 3);
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt, {path, "'minimax-m3.block_count'", "appears twice"});
  }
  SECTION("bad alignments") {
    for (uint32_t a : {0u, 48u, 3u, 1u << 30}) {
      GgufWriter g = SmallModel();
      g.SetU32("general.alignment", a);
      RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt,
                   {path, "general.alignment = " + std::to_string(a), "power of two"});
    }
    GgufWriter g = SmallModel();
    g.SetString("general.alignment", "32");
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt, {path, "'general.alignment'", "not an integer"});
  }
}

TEST_CASE("damaged GGUF tensor infos and data ranges are refused", "[gguf]") {
  TempDir dir;
  const std::string path = (dir.path() / "x.gguf").string();
  const std::string q8 = Pattern(34, 9);

  SECTION("too many dimensions, negative sizes, overflowing counts") {
    GgufWriter g;
    g.AddTensor("blk.0.attn_q.weight", 0, {1, 1, 1, 1, 1}, "abcd");
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt, {path, "'blk.0.attn_q.weight'", "5 dimensions"});
    GgufWriter n;
    n.AddTensor("blk.0.attn_q.weight", 0, {4, -1}, "abcd");
    RequireError(OpenBytes(dir, n.Bytes()), StatusCode::kCorrupt, {path, "'blk.0.attn_q.weight'", "negative size -1"});
    GgufWriter o;
    o.AddTensor("big", 0, {1ll << 40, 1ll << 40}, "abcd");
    RequireError(OpenBytes(dir, o.Bytes()), StatusCode::kCorrupt, {path, "'big'", "overflows"});
    GgufWriter b;  // the element count fits, its bytes do not
    b.AddTensor("big", 0, {1ll << 31, 1ll << 31, 2}, "abcd");
    RequireError(OpenBytes(dir, b.Bytes()), StatusCode::kCorrupt, {path, "'big'", "overflows"});
    GgufWriter p;  // fits in 64 bits, not in the file
    p.AddTensor("blk.0.attn_q.weight", Id(GgmlType::kQ8_0), {1ll << 20, 1ll << 20}, q8);
    RequireError(OpenBytes(dir, p.Bytes()), StatusCode::kCorrupt,
                 {path, "tensor 'blk.0.attn_q.weight' data [", "runs past the end of the file"});
  }
  SECTION("unknown type ids") {
    GgufWriter g;
    g.AddTensor("blk.0.attn_q.weight", 99, {32}, q8);
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kUnsupported, {path, "'blk.0.attn_q.weight'", "ggml type id 99"});
    GgufWriter removed;  // Q4_2, long removed from ggml
    removed.AddTensor("t", 4, {32}, q8);
    RequireError(OpenBytes(dir, removed.Bytes()), StatusCode::kUnsupported, {path, "'t'", "ggml type id 4"});
  }
  SECTION("rows that are not whole blocks") {
    GgufWriter g;
    g.AddTensor("blk.0.ffn_down.weight", Id(GgmlType::kQ4_K), {128, 2}, Pattern(144, 1));
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt,
                 {path, "'blk.0.ffn_down.weight'", "Q4_K", "ne[0] = 128", "block of 256"});
  }
  SECTION("misaligned, overlapping and out-of-file data") {
    GgufWriter m;
    m.AddTensor("a", Id(GgmlType::kQ8_0), {32}, q8, 16);
    RequireError(OpenBytes(dir, m.Bytes()), StatusCode::kCorrupt, {path, "'a'", "offset 16", "alignment 32"});
    GgufWriter o;
    o.AddTensor("a", Id(GgmlType::kQ8_0), {64}, Pattern(68, 1), 0).AddTensor("b", Id(GgmlType::kQ8_0), {32}, q8, 32);
    RequireError(OpenBytes(dir, o.Bytes()), StatusCode::kCorrupt, {path, "'a'", "'b'", "overlap"});
    GgufWriter same;  // two names, one range
    same.AddTensor("a", Id(GgmlType::kQ8_0), {32}, q8, 0).AddTensor("b", Id(GgmlType::kQ8_0), {32}, q8, 0);
    RequireError(OpenBytes(dir, same.Bytes()), StatusCode::kCorrupt, {path, "overlap"});
    GgufWriter far;
    far.AddTensor("a", Id(GgmlType::kQ8_0), {32}, q8).AddTensor("blk.0.attn_q.weight", Id(GgmlType::kQ8_0), {32}, q8, 1ull << 40);
    RequireError(OpenBytes(dir, far.Bytes()), StatusCode::kCorrupt,
                 {path, "tensor 'blk.0.attn_q.weight' data [", "runs past the end of the file"});
    GgufWriter wrap;  // data start + offset wraps around 64 bits
    wrap.AddTensor("a", Id(GgmlType::kQ8_0), {32}, q8, ~0ull - 31);
    RequireError(OpenBytes(dir, wrap.Bytes()), StatusCode::kCorrupt, {path, "'a'", "runs past the end of the file"});
    // Zero-sized tensors take no bytes, so they overlap nothing.
    GgufWriter empty;
    empty.AddTensor("a", Id(GgmlType::kQ8_0), {32}, q8, 0).AddTensor("z", Id(GgmlType::kQ8_0), {0, 4}, "", 0);
    auto ok = OpenBytes(dir, empty.Bytes());
    RequireOk(ok);
    CHECK((*ok)->tensors()[1].nbytes == 0);
    CHECK((*ok)->tensors()[1].n_rows() == 0);
  }
  SECTION("duplicate names") {
    GgufWriter g;
    g.AddTensor("blk.0.attn_q.weight", Id(GgmlType::kQ8_0), {32}, q8).AddTensor("x", 0, {1}, "abcd")
        .AddTensor("blk.0.attn_q.weight", Id(GgmlType::kQ8_0), {32}, q8);
    RequireError(OpenBytes(dir, g.Bytes()), StatusCode::kCorrupt,
                 {path, "'blk.0.attn_q.weight'", "appears twice", "tensors 0 and 2"});
  }
}

// ----------------------------------------------------------------------------------------------
// Split sets.

TEST_CASE("GGUF split sets open from any shard and expose every tensor", "[gguf]") {
  TempDir dir;
  GgufWriter g = SmallModel();
  g.AddTensor("blk.1.attn_q.weight", Id(GgmlType::kQ8_0), {32, 3}, Pattern(3 * 34, 4));
  const auto paths = g.WriteSplit(dir.path(), "MiniMax-M3-Q4_K", 3);
  REQUIRE(paths.size() == 3);
  CHECK(paths[1].filename() == "MiniMax-M3-Q4_K-00002-of-00003.gguf");
  for (const auto& p : paths) {
    INFO(p.string());
    auto set = GgufShardSet::Open(p.string());
    RequireOk(set);
    REQUIRE((*set)->shards().size() == 3);
    CHECK((*set)->shards()[0]->path() == paths[0].string());
    CHECK((*set)->shards()[2]->path() == paths[2].string());
    REQUIRE((*set)->tensors().size() == 5);
    CHECK((*set)->tensors()[0]->name == "token_embd.weight");
    CHECK((*set)->tensors()[4]->name == "blk.1.attn_q.weight");
    CHECK(RequireOk((*set)->metadata().GetString("general.architecture")) == "minimax-m3");
    const m3::GgufTensorInfo* q = (*set)->Find("blk.1.attn_q.weight");
    REQUIRE(q);
    CHECK(q->file == (*set)->shards()[2].get());
    CHECK(std::string(reinterpret_cast<const char*>(q->data), q->nbytes) == Pattern(3 * 34, 4));
    CHECK((*set)->Find("nope") == nullptr);
  }
  // A single file is a set of one, whatever its name.
  g.Write(dir.path() / "single-00001-of-00003.gguf");
  auto single = GgufShardSet::Open((dir.path() / "single-00001-of-00003.gguf").string());
  RequireOk(single);
  CHECK((*single)->shards().size() == 1);
  CHECK((*single)->tensors().size() == 5);
  // And so is a set of one written by gguf-split.
  const auto one = g.WriteSplit(dir.path(), "one", 1);
  auto set_of_one = GgufShardSet::Open(one[0].string());
  RequireOk(set_of_one);
  CHECK((*set_of_one)->tensors().size() == 5);
}

TEST_CASE("GGUF split sets with a missing, duplicated or foreign shard are refused", "[gguf]") {
  TempDir dir;
  GgufWriter g = SmallModel();
  const auto paths = g.WriteSplit(dir.path(), "m", 3);
  const std::string first = paths[0].string();

  SECTION("missing") {
    fs::remove(paths[1]);
    RequireError(GgufShardSet::Open(first), StatusCode::kNotFound, {paths[1].string(), "shard 2 of 3", "missing"});
    RequireError(GgufShardSet::Open(paths[2].string()), StatusCode::kNotFound, {paths[1].string(), "missing"});
  }
  SECTION("a shard copied over another") {
    fs::copy_file(paths[1], paths[2], fs::copy_options::overwrite_existing);
    RequireError(GgufShardSet::Open(first), StatusCode::kCorrupt, {paths[2].string(), "split.no = 1", "shard 3"});
    // Opened through the copy: its name and its keys disagree.
    RequireError(GgufShardSet::Open(paths[2].string()), StatusCode::kCorrupt,
                 {paths[2].string(), "shard 3 of 3", "split.no = 1"});
  }
  SECTION("a shard of another set") {
    GgufWriter other = SmallModel();
    other.AddTensor("extra", 0, {1}, "abcd");
    const auto theirs = other.WriteSplit(dir.path(), "other", 3);
    fs::copy_file(theirs[2], paths[2], fs::copy_options::overwrite_existing);
    RequireError(GgufShardSet::Open(first), StatusCode::kCorrupt, {paths[2].string(), "split.tensors.count = 5", "4"});
    const auto two = other.WriteSplit(dir.path(), "two", 2);
    fs::copy_file(two[1], paths[1], fs::copy_options::overwrite_existing);
    RequireError(GgufShardSet::Open(first), StatusCode::kCorrupt, {paths[1].string(), "split.count = 2"});
  }
  SECTION("a plain file in a shard's place") {
    SmallModel().Write(paths[1]);
    RequireError(GgufShardSet::Open(first), StatusCode::kCorrupt, {paths[1].string(), "no split.count"});
  }
  SECTION("a tensor in two shards") {
    GgufWriter dup;
    dup.AddTensor("a", 0, {1}, "abcd").AddTensor("b", 0, {1}, "efgh").AddTensor("a", 0, {1}, "ijkl");
    const auto d = dup.WriteSplit(dir.path(), "dup", 3);
    RequireError(GgufShardSet::Open(d[0].string()), StatusCode::kCorrupt, {d[2].string(), "'a'", "also in", d[0].string()});
  }
  SECTION("split keys that disagree with the tensors") {
    // Shard 1 claims 4 tensors in all, but the shards hold 3.
    GgufWriter few;
    few.AddTensor("a", 0, {1}, "abcd").AddTensor("b", 0, {1}, "efgh").AddTensor("c", 0, {1}, "ijkl");
    const auto f = few.WriteSplit(dir.path(), "few", 3);
    for (const auto& p : f) {
      std::string bytes = ReadBytes(p);
      const size_t at = bytes.find("split.tensors.count") + std::strlen("split.tensors.count") + 4;
      WriteBytes(p, Patch<int32_t>(bytes, at, 4));
    }
    RequireError(GgufShardSet::Open(f[1].string()), StatusCode::kCorrupt, {f[0].string(), "split.tensors.count = 4", "hold 3"});
  }
  SECTION("a shard whose name says nothing of its place") {
    fs::rename(paths[1], dir.path() / "renamed.gguf");
    RequireError(GgufShardSet::Open((dir.path() / "renamed.gguf").string()), StatusCode::kCorrupt,
                 {"renamed.gguf", "NAME-00001-of-00003.gguf"});
  }
  SECTION("split.count out of range") {
    GgufWriter bad = SmallModel();
    bad.SetI32("split.count", -2);
    bad.Write(dir.path() / "bad.gguf");
    RequireError(GgufShardSet::Open((dir.path() / "bad.gguf").string()), StatusCode::kCorrupt, {"split.count = -2"});
  }
}

// ----------------------------------------------------------------------------------------------
// Dequantization.

namespace {

std::string FixturePath() { return m3::test::DataDir() + "/gguf/ggml_reference.gguf"; }

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

}  // namespace

TEST_CASE("GGUF dequantization gives ggml's floats bit for bit", "[gguf][dequant]") {
  auto set = GgufShardSet::Open(FixturePath());
  RequireOk(set);
  const std::vector<std::pair<std::string, GgmlType>> cases = {
      {"f16", GgmlType::kF16},   {"bf16", GgmlType::kBF16}, {"q8_0", GgmlType::kQ8_0}, {"q4_0", GgmlType::kQ4_0},
      {"q4_1", GgmlType::kQ4_1}, {"q5_0", GgmlType::kQ5_0}, {"q5_1", GgmlType::kQ5_1}, {"q2_k", GgmlType::kQ2_K},
      {"q3_k", GgmlType::kQ3_K}, {"q4_k", GgmlType::kQ4_K}, {"q5_k", GgmlType::kQ5_K}, {"q6_k", GgmlType::kQ6_K}};
  for (const auto& [name, type] : cases) {
    INFO(name);
    const m3::GgufTensorInfo* q = (*set)->Find(name);
    const m3::GgufTensorInfo* ref = (*set)->Find(name + ".ggml_f32");
    REQUIRE(q);
    REQUIRE(ref);
    CHECK(q->type == type);
    CHECK(m3::CanDequantizeGgml(type));
    REQUIRE(ref->type == GgmlType::kF32);
    REQUIRE(q->ne == ref->ne);
    REQUIRE(q->n_rows() == 2);
    std::vector<float> ours(q->n_elements), theirs(ref->n_elements);
    RequireOk(m3::DequantizeGgufRows(*q, 0, q->n_rows(), ours.data()));
    RequireOk(m3::DequantizeGgufRows(*ref, 0, ref->n_rows(), theirs.data()));
    size_t differ = 0, nonzero = 0;
    for (size_t i = 0; i < ours.size(); ++i) {
      if (Bits(ours[i]) != Bits(theirs[i])) {
        if (differ++ < 5) UNSCOPED_INFO("value " << i << ": ours " << ours[i] << ", ggml's " << theirs[i]);
      }
      nonzero += theirs[i] != 0;
    }
    CHECK(differ == 0);
    CHECK(nonzero > ours.size() / 4);  // the fixture is not all zeros
    // Row by row, from the middle of the tensor: the same values.
    std::vector<float> row(q->row_elements());
    RequireOk(m3::DequantizeGgufRows(*q, 1, 1, row.data()));
    CHECK(std::memcmp(row.data(), ours.data() + q->row_elements(), row.size() * 4) == 0);
  }
}

TEST_CASE("GGUF type table agrees with ggml's, and the fixture's metadata reads back", "[gguf]") {
  auto file = GgufFile::Open(FixturePath());
  RequireOk(file);
  const m3::GgufMetadata& m = (*file)->metadata();
  const auto names = RequireOk(m.GetStringArray("ggml.type_name"));
  const auto blocks = RequireOk(m.GetIntArray("ggml.block_size"));
  const auto sizes = RequireOk(m.GetNumberArray("ggml.type_size"));
  REQUIRE(names.size() == blocks.size());
  REQUIRE(names.size() == sizes.size());
  REQUIRE(names.size() >= 40);
  size_t known = 0;
  for (uint32_t id = 0; id < names.size(); ++id) {
    INFO("ggml type " << id << " " << names[id]);
    const m3::GgmlTypeInfo* ours = m3::FindGgmlType(id);
    if (blocks[id] == 0) {  // removed from ggml
      CHECK(ours == nullptr);
      continue;
    }
    REQUIRE(ours != nullptr);
    ++known;
    CHECK(static_cast<uint32_t>(ours->type) == id);
    CHECK(ours->block_elements == blocks[id]);
    CHECK(ours->block_bytes == sizes[id]);
    std::string lower = ours->name;
    for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    std::string theirs(names[id]);
    for (char& c : theirs) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    CHECK(lower == theirs);
  }
  CHECK(known == 35);
  CHECK(m3::FindGgmlType(static_cast<uint32_t>(names.size())) == nullptr);

  // Metadata ggml's writer stored (tests/data/gguf/make_fixture.cc).
  CHECK((*file)->version() == 3);
  CHECK((*file)->alignment() == 32);
  CHECK(RequireOk(m.GetInt("fixture.u8")) == 200);
  CHECK(RequireOk(m.GetInt("fixture.i8")) == -100);
  CHECK(RequireOk(m.GetInt("fixture.u16")) == 60000);
  CHECK(RequireOk(m.GetInt("fixture.i16")) == -30000);
  CHECK(RequireOk(m.GetInt("fixture.u32")) == 4000000000ll);
  CHECK(RequireOk(m.GetInt("fixture.i32")) == -2000000000);
  CHECK(RequireOk(m.GetFloat("fixture.f32")) == static_cast<double>(0.1f));
  CHECK(RequireOk(m.GetBool("fixture.bool")));
  CHECK(RequireOk(m.GetString("fixture.string")) == "minimax-m3 \xc3\xa9\xe2\x9c\x93");
  RequireError(m.GetInt("fixture.u64"), StatusCode::kOutOfRange, {"'fixture.u64'", "18000000000000000000"});
  CHECK(m.Find("fixture.u64")->type == GgufValueType::kU64);
  CHECK(RequireOk(m.GetInt("fixture.i64")) == -9000000000000000000ll);
  CHECK(RequireOk(m.GetFloat("fixture.f64")) == 1e300);
  CHECK(RequireOk(m.GetIntArray("fixture.i32s")) == std::vector<int64_t>{1, -2, 3, 2147483647});
  CHECK(RequireOk(m.GetNumberArray("fixture.f32s")) ==
        std::vector<double>{0.5, -1.25, static_cast<double>(1e-30f)});
  CHECK(RequireOk(m.GetIntArray("fixture.u8s")) == std::vector<int64_t>{0, 255});
  CHECK(RequireOk(m.GetStringArray("fixture.strings")) == std::vector<std::string_view>{"<s>", "", "\xc4\xa0the", "a b"});
}

TEST_CASE("plain GGUF element types decode exactly", "[gguf][dequant]") {
  // fp16: 1, -2, the smallest subnormal, the largest finite, -inf; bf16: 1, -0.5, 2^-133 (a subnormal).
  const uint16_t f16[] = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0xFC00};
  const uint16_t bf16[] = {0x3F80, 0xBF00, 0x0001};
  float out[5];
  RequireOk(m3::DequantizeGgml(GgmlType::kF16, reinterpret_cast<const uint8_t*>(f16), 5, out));
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == std::ldexp(1.0f, -24));
  CHECK(out[3] == 65504.0f);
  CHECK(out[4] == -std::numeric_limits<float>::infinity());
  RequireOk(m3::DequantizeGgml(GgmlType::kBF16, reinterpret_cast<const uint8_t*>(bf16), 3, out));
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -0.5f);
  CHECK(out[2] == std::ldexp(1.0f, -133));
  const float f32[] = {1.5f, -0.0f, 3e38f};
  RequireOk(m3::DequantizeGgml(GgmlType::kF32, reinterpret_cast<const uint8_t*>(f32), 3, out));
  CHECK(std::memcmp(out, f32, sizeof(f32)) == 0);
  // Q8_0: d = 0.5 (fp16 0x3800), codes -128, 0, 127, ...
  uint8_t q8[34] = {0x00, 0x38};
  q8[2] = 0x80;
  q8[4] = 127;
  float q8_out[32];
  RequireOk(m3::DequantizeGgml(GgmlType::kQ8_0, q8, 32, q8_out));
  CHECK(q8_out[0] == -64.0f);
  CHECK(q8_out[1] == 0.0f);
  CHECK(q8_out[2] == 63.5f);
}

TEST_CASE("DequantizeGgml refuses types it cannot decode and partial blocks", "[gguf][dequant]") {
  std::vector<uint8_t> src(1024);
  std::vector<float> out(512);
  const m3::Status iq = m3::DequantizeGgml(GgmlType::kIQ4_XS, src.data(), 256, out.data());
  CHECK(iq.code() == StatusCode::kUnsupported);
  CHECK_THAT(iq.message(), Contains("IQ4_XS"));
  CHECK_FALSE(m3::CanDequantizeGgml(GgmlType::kQ8_K));
  CHECK(m3::DequantizeGgml(static_cast<GgmlType>(77), src.data(), 1, out.data()).code() == StatusCode::kUnsupported);
  const m3::Status partial = m3::DequantizeGgml(GgmlType::kQ6_K, src.data(), 128, out.data());
  CHECK(partial.code() == StatusCode::kInvalidArgument);
  CHECK_THAT(partial.message(), Contains("Q6_K") && Contains("256"));
  CHECK(RequireOk(m3::GgmlByteSize(GgmlType::kQ4_K, 512)) == 288);
  CHECK_FALSE(m3::GgmlByteSize(GgmlType::kQ4_K, 100).ok());
  CHECK_FALSE(m3::GgmlByteSize(GgmlType::kF64, ~0ull).ok());
  CHECK(std::string(m3::GgmlTypeName(static_cast<GgmlType>(77))) == "?");
}
