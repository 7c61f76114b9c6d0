// Shared helpers for the tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <random>
#include <vector>
#include <regex>
#include <sstream>
#include <string>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "base/status.h"

namespace m3::test {

// The golden cases of the repository's copy (tests/data/golden).
inline constexpr const char* kGoldenCases[] = {"s1_fp32_basic",
                                               "s2_bf16_sharded_init1",
                                               "s3_mxfp8_mixed_layers_local2",
                                               "s4_vl_bf16_full_rotary_topk_gt_blocks",
                                               "s5_realprop_mxfp8_vl",
                                               "s6_fp16_mha_top1_sharded3"};

inline std::string ReadBytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  REQUIRE(in);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void WriteBytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  REQUIRE(out);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out);
}

// Largest |a - b| relative to 1 + max |b| over n values.
inline double RelDiff(const float* a, const float* b, size_t n) {
  double err = 0, mag = 0;
  for (size_t i = 0; i < n; ++i) {
    err = std::max(err, std::fabs(double(a[i]) - b[i]));
    mag = std::max(mag, std::fabs(double(b[i])));
  }
  return err / (1 + mag);
}

// Test data: the repository's copy (tests/data: golden cases, the oracle, the tokenizer files),
// and ../shared beside the clone when it is there, whose cases may be more than the copy's: the
// tests that walk every case walk both (DataRoots). Set at configure time.
// Both may be moved at run time (M3_TEST_DATA_DIR, M3_SHARED_DIR): scripts/check-cuda.sh runs the
// test binaries built here on a GPU machine, where the repository lies elsewhere.
inline std::string DataDir() {
  const char* moved = std::getenv("M3_TEST_DATA_DIR");
  return moved && *moved ? moved : M3_TEST_DATA_DIR;
}
inline std::string SharedDir() {
  const char* moved = std::getenv("M3_SHARED_DIR");
  return moved && *moved ? moved : M3_SHARED_DIR;
}
inline std::vector<std::string> DataRoots() {
  std::vector<std::string> roots{DataDir()};
  std::error_code ec;
  if (std::filesystem::is_directory(SharedDir() + "/golden", ec) &&
      !std::filesystem::equivalent(SharedDir(), DataDir(), ec))
    roots.push_back(SharedDir());
  return roots;
}
inline std::string GoldenDir(const std::string& name) { return DataDir() + "/golden/" + name; }
inline std::string TokenizerDir() { return DataDir() + "/tokenizer/minimax-m3"; }

// Every golden case folder of every root (a case in both: ../shared's), sorted by name.
inline std::vector<std::pair<std::string, std::string>> GoldenCases() {
  std::map<std::string, std::string> cases;
  for (const std::string& root : DataRoots()) {
    const auto dir = std::filesystem::path(root) / "golden";
    std::error_code ec;
    if (!std::filesystem::is_directory(dir, ec)) continue;
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (std::filesystem::exists(e.path() / "case.json")) cases[e.path().filename().string()] = e.path().string();
  }
  return {cases.begin(), cases.end()};
}

// `file` (golden.jsonl, chat_golden.jsonl) of the tokenizer folder of every root that has it.
inline std::vector<std::string> TokenizerGoldenFiles(const std::string& file) {
  std::vector<std::string> files;
  for (const std::string& root : DataRoots()) {
    const std::string path = root + "/tokenizer/minimax-m3/" + file;
    if (std::filesystem::exists(path)) files.push_back(path);
  }
  return files;
}

// The call must fail with `code` and a message containing every fragment.
template <class T>
void RequireError(const StatusOr<T>& r, StatusCode code, std::initializer_list<std::string> fragments) {
  REQUIRE_FALSE(r.ok());
  INFO("message: " << r.status().message());
  CHECK(r.status().code() == code);
  for (const auto& f : fragments) CHECK_THAT(r.status().message(), Catch::Matchers::Contains(f));
}

// n normally distributed floats, reproducible from `seed`.
inline std::vector<float> RandomVec(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Reads JSON written by Python's json module, which may contain the non-standard tokens
// Infinity, -Infinity and NaN (e.g. an infinite decision margin); they become null.
inline nlohmann::json ReadPythonJson(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  static const std::regex non_finite(R"(-?\bInfinity\b|\bNaN\b)");
  return nlohmann::json::parse(std::regex_replace(ss.str(), non_finite, "null"));
}

// A fresh empty folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("m3_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  std::filesystem::path path_;
};

#ifdef M3_REAL_VOCAB_MODEL
// The tiny model with the real vocabulary that ctest's fixture make_real_vocab_model makes
// (tests/make_real_vocab_model.sh), for tests registered with that fixture.
inline std::string RealVocabModel() {
  const std::string dir = M3_REAL_VOCAB_MODEL;
  INFO("missing " << dir << ": run ctest (its fixture make_real_vocab_model makes it)");
  REQUIRE(std::filesystem::exists(dir + "/config.json"));
  return dir;
}
#endif

}  // namespace m3::test
