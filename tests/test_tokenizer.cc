// The byte-level BPE tokenizer (lib/text/tokenizer.cc) against the HF `tokenizers` goldens for
// MiniMax-M3: encode, decode with and without special tokens, streaming decode; then the edge
// cases HF defines through Rust's lossy UTF-8, hostile input, and refused tokenizer files.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "text/bpe.h"
#include "text/byte_level.h"
#include "text/onig_compat.h"
#include "text/regex_split.h"
#include "text/tokenizer.h"
#include "test_util.h"

namespace {

using m3::StatusCode;
using m3::StreamingDecoder;
using m3::Tokenizer;
using Catch::Matchers::Contains;
using nlohmann::json;

using m3::test::TokenizerDir;

// Loaded once: parsing the 9.7 MB JSON is the slow part of every test.
const Tokenizer& MiniMax() {
  static const std::unique_ptr<Tokenizer> tok = [] {
    auto r = Tokenizer::Load(TokenizerDir());
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    return std::move(r).value();
  }();
  return *tok;
}

// The cases of one golden.jsonl (the repository's copy unless another is given).
std::vector<json> Goldens(const std::string& file = TokenizerDir() + "/golden.jsonl") {
  std::ifstream in(file);
  REQUIRE(in.good());
  std::vector<json> cases;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) cases.push_back(json::parse(line));
  }
  return cases;
}

std::string StreamDecode(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  StreamingDecoder dec(tok, skip);
  std::string all;
  for (int32_t id : ids) {
    const std::string piece = dec.Push(id);
    INFO("piece after id " << id);
    CHECK(m3::byte_level::IsValidUtf8(piece));
    all += piece;
  }
  const std::string tail = dec.Flush();
  CHECK(m3::byte_level::IsValidUtf8(tail));
  return all + tail;
}

TEST_CASE("tokenizer: every golden case encodes and decodes like HF", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  // The repository's copy and ../shared's when it is there (which may hold more cases).
  std::vector<json> cases;
  for (const std::string& file : m3::test::TokenizerGoldenFiles("golden.jsonl")) {
    const std::vector<json> more = Goldens(file);
    INFO(file);
    REQUIRE(more.size() >= 329);
    cases.insert(cases.end(), more.begin(), more.end());
  }
  int passed = 0;
  for (const json& c : cases) {
    INFO("case " << c["id"].get<std::string>());
    const std::string text = c["text"];
    const std::vector<int32_t> ids = c["ids"];
    const std::string decoded = c["decoded"], decoded_skip = c["decoded_skip_special"];
    const std::vector<int32_t> got = tok.Encode(text);
    CHECK(got == ids);
    CHECK(tok.Decode(ids, false) == decoded);
    CHECK(tok.Decode(ids, true) == decoded_skip);
    CHECK(StreamDecode(tok, ids, false) == decoded);
    CHECK(StreamDecode(tok, ids, true) == decoded_skip);
    const std::vector<std::string> tokens = c["tokens"];
    REQUIRE(tokens.size() == ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      CHECK(tok.TokenString(ids[i]) == tokens[i]);
      CHECK(tok.TokenId(tokens[i]) == ids[i]);
    }
    passed += got == ids;
  }
  CHECK(passed == static_cast<int>(cases.size()));
}

// Where PCRE2 (Unicode 14) and ICU (15) differ from HF's Oniguruma (16) and its NFC tables (9.0):
// characters new since then, \s without U+180E, marks HF does not reorder. Ids from HF tokenizers.
TEST_CASE("tokenizer: Unicode version edge cases match HF", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"x\u0CF3's", {120, 195900, 179, 692}},                 // Mc new in 15.0 joins the word
      {"\u1C89abc", {225, 178, 137, 34972}},                  // Lu new in 16.0
      {"a\u180E's", {97, 225, 160, 142, 39, 115}},            // U+180E is not \s in Oniguruma
      {"\u180E\u180E!", {225, 160, 142, 225, 160, 142, 33}},
      {"A\u0334\u0D3B\u0301", {65, 204, 180, 62450, 187, 21213}},  // U+0D3B: no reordering
      {"e\u0D3C\u0301", {101, 62450, 188, 21213}},
      {"\U00031350\U00031351's", {240, 177, 141, 144, 240, 177, 141, 145, 692}},  // CJK ext H
      {"it'\u017F", {277, 39, 158967}},
      {"x\u00A0\u00A0y", {120, 1330, 1330, 121}},
      {"\u1E0B\u0323", {72474, 141, 204, 135}},              // NFC reorders and recomposes
      {"\uD55C\u1100\u1161\u11A8", {2311, 16788}},         // Hangul jamo compose
  };
  for (const auto& [text, ids] : cases) {
    INFO("text " << text);
    CHECK(tok.Encode(text) == ids);
  }
}

TEST_CASE("tokenizer: vocabulary and added tokens", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  CHECK(tok.vocab_size() == 200061);
  CHECK(tok.TokenId("Ġworld") == 2035);
  CHECK(tok.TokenId("[e~[") == 200020);
  CHECK(tok.TokenId("no such token here") == -1);
  CHECK(tok.IsSpecial(200020));
  CHECK_FALSE(tok.IsSpecial(200058));  // ]<]minimax[>[ is added but not special
  CHECK(tok.IsAdded(200058));
  CHECK_FALSE(tok.IsSpecial(2035));
  CHECK_FALSE(tok.IsSpecial(-1));
  CHECK_FALSE(tok.IsSpecial(1 << 30));
  CHECK(tok.TokenString(200059) == "<mm:think>");
  CHECK(tok.TokenString(-5).empty());
  CHECK(tok.TokenString(200061).empty());
  CHECK(tok.TokenBytes(2035) == " world");
  // Ids 0..255 are the single bytes in byte order.
  for (int b = 0; b < 256; ++b) CHECK(tok.TokenBytes(b) == std::string(1, static_cast<char>(b)));
}

// Expected strings produced by HF tokenizers (node binding 0.23.2) for ids that split UTF-8
// sequences; every invalid maximal subpart becomes one U+FFFD, runs split by added tokens are
// repaired separately.
TEST_CASE("tokenizer: decode of broken UTF-8 matches HF", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  struct Case {
    std::vector<int32_t> ids;
    bool skip;
    std::string want;
  };
  const std::vector<Case> cases = {
      {{228, 189}, false, "\uFFFD"},
      {{228, 200000, 189, 160}, true, "你"},
      {{228, 200000, 189, 160}, false, "\uFFFD]!p~[\uFFFD\uFFFD"},
      {{228, 200050, 189, 160}, true, "\uFFFD<think>\uFFFD\uFFFD"},
      {{240, 159, 152}, false, "\uFFFD"},
      {{237, 160, 128}, false, "\uFFFD\uFFFD\uFFFD"},         // a surrogate
      {{192, 175}, false, "\uFFFD\uFFFD"},                     // overlong
      {{244, 144, 128, 128}, false, "\uFFFD\uFFFD\uFFFD\uFFFD"},  // above U+10FFFF
      {{255, 65, 254}, false, "\uFFFDA\uFFFD"},
      {{240, 159, 152, 128, 228}, false, "😀\uFFFD"},
      {{999999, 65, -1, 1 << 30}, false, "A"},  // unknown ids are skipped, as in HF
  };
  for (const Case& c : cases) {
    INFO("ids[0] " << c.ids[0] << " skip " << c.skip);
    CHECK(tok.Decode(c.ids, c.skip) == c.want);
    CHECK(StreamDecode(tok, c.ids, c.skip) == c.want);
  }
}

TEST_CASE("tokenizer: streaming holds back an unfinished character", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  StreamingDecoder dec(tok);
  CHECK(dec.Push(240).empty());  // 😀 = F0 9F 98 80, one byte token at a time
  CHECK(dec.Push(159).empty());
  CHECK(dec.Push(152).empty());
  CHECK(dec.Push(128) == "😀");
  CHECK(dec.Push(228).empty());
  CHECK(dec.Push(65) == "\uFFFDA");  // 'A' proves E4 unfinished: it is settled, then A follows
  CHECK(dec.Push(228).empty());
  CHECK(dec.Flush() == "\uFFFD");
  CHECK(dec.Flush().empty());
}

TEST_CASE("tokenizer: invalid UTF-8 input is repaired to U+FFFD before encoding", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  CHECK(tok.Encode("a\xFF" "b") == tok.Encode("a\uFFFDb"));
  CHECK(tok.Encode("x\xE4\xBD") == tok.Encode("x\uFFFD"));          // truncated: one U+FFFD
  CHECK(tok.Encode("\xED\xA0\x80") == tok.Encode("\uFFFD\uFFFD\uFFFD"));  // surrogate
  CHECK(tok.Encode(std::string("nul\0byte", 8)) == std::vector<int32_t>({110, 353, 0, 16954}));
  CHECK(tok.Encode("").empty());
}

TEST_CASE("tokenizer: random bytes and random ids never crash", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  std::mt19937 rng(1234);
  const std::string alphabet[] = {"a", " ", "\n", "é", "中", "😀", "<mm:think>", "[e~[", "'s",
                                  "1", "\xFF", "\xE4", "\x80", "\t", "\u3000", "\u0301"};
  for (int iter = 0; iter < 300; ++iter) {
    std::string text;
    const int len = static_cast<int>(rng() % 200);
    for (int i = 0; i < len; ++i) {
      if (rng() % 3 == 0) {
        text.push_back(static_cast<char>(rng() % 256));
      } else {
        text += alphabet[rng() % std::size(alphabet)];
      }
    }
    const std::vector<int32_t> ids = tok.Encode(text);
    for (int32_t id : ids) REQUIRE((id >= 0 && static_cast<size_t>(id) < tok.vocab_size()));
    const std::string back = tok.Decode(ids, false);
    CHECK(m3::byte_level::IsValidUtf8(back));
    // Decoding gives the normalized text back, which encodes to the same ids again.
    CHECK(tok.Encode(back) == ids);
  }
  for (int iter = 0; iter < 300; ++iter) {
    std::vector<int32_t> ids(rng() % 50);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % 200100) - 20;
    const std::string a = tok.Decode(ids, false);
    CHECK(m3::byte_level::IsValidUtf8(a));
    CHECK(StreamDecode(tok, ids, false) == a);
    CHECK(StreamDecode(tok, ids, true) == tok.Decode(ids, true));
  }
}

TEST_CASE("tokenizer: long runs encode (heap BPE path, regex backtracking)", "[tokenizer]") {
  const Tokenizer& tok = MiniMax();
  for (const std::string unit : {"a", " ", "\n", "中", "ab", "1", "!", "\u0301"}) {
    std::string text;
    for (int i = 0; i < 20000; ++i) text += unit;
    const std::vector<int32_t> ids = tok.Encode(text);
    CHECK(ids.size() < text.size());
    CHECK(tok.Decode(ids, false) == text);
  }
}

// BpeMerge's two strategies (rescan for short words, heap for long ones) against a direct
// transcription of the rule, on random merge tables.
TEST_CASE("bpe: short and long merge paths agree with the reference rule", "[tokenizer]") {
  std::mt19937 rng(99);
  for (int table = 0; table < 20; ++table) {
    m3::MergeTable merges;
    const int symbols = 4 + static_cast<int>(rng() % 4);
    int next_id = symbols;
    std::vector<std::tuple<int32_t, int32_t, int32_t>> list;  // rank = index
    for (int r = 0; r < 60; ++r) {
      const int32_t a = static_cast<int32_t>(rng() % next_id), b = static_cast<int32_t>(rng() % next_id);
      list.emplace_back(a, b, next_id);
      merges.Insert(a, b, {r, next_id++});
    }
    auto find = [&](int32_t a, int32_t b) {
      int best = -1;  // a later duplicate replaces an earlier one
      for (size_t r = 0; r < list.size(); ++r) {
        if (std::get<0>(list[r]) == a && std::get<1>(list[r]) == b) best = static_cast<int>(r);
      }
      return best;
    };
    for (int word = 0; word < 20; ++word) {
      std::vector<int32_t> ids(1 + rng() % 150);
      for (int32_t& id : ids) id = static_cast<int32_t>(rng() % symbols);
      std::vector<int32_t> want = ids;
      for (;;) {
        int best_rank = -1;
        size_t best = 0;
        for (size_t i = 0; i + 1 < want.size(); ++i) {
          const int r = find(want[i], want[i + 1]);
          if (r >= 0 && (best_rank < 0 || r < best_rank)) best_rank = r, best = i;
        }
        if (best_rank < 0) break;
        want[best] = std::get<2>(list[best_rank]);
        want.erase(want.begin() + static_cast<ptrdiff_t>(best) + 1);
      }
      m3::BpeMerge(merges, ids);
      CHECK(ids == want);
    }
  }
}

TEST_CASE("onig_compat: Oniguruma escapes are rewritten for PCRE2", "[tokenizer]") {
  auto conv = [](const std::string& p) {
    auto r = m3::OnigPatternToPcre2(p);
    INFO(p << ": " << r.status().ToString());
    REQUIRE(r.ok());
    return r.value();
  };
  CHECK(conv("\\h+") == "[0-9A-Fa-f]+");
  CHECK(conv("\\u00e9") == "\\x{00e9}");
  CHECK(conv("\\p{Greek}[\\p{Han}]") == "\\p{Greek}[\\p{Han}]");
  CHECK(conv("a\\Q\\s\\E") == "a\\Q\\s\\E");
  CHECK_THAT(conv("\\p{Lu}"), Contains("[\\p{Lu}") && Contains("\\x{1c89}"));
  CHECK_THAT(conv("[^\\p{L}]"), Contains("[^\\p{L}\\x{"));
  CHECK_THAT(conv("\\s"), !Contains("180e"));
  CHECK(m3::OnigPatternToPcre2("[a[b]]").status().code() == StatusCode::kUnsupported);
  CHECK(m3::OnigPatternToPcre2("[a&&b]").status().code() == StatusCode::kUnsupported);

  auto split = m3::RegexSplit::Create("\\s+", false, m3::RegexSplit::Behavior::kIsolated, false);
  REQUIRE(split.ok());
  std::vector<std::string_view> pieces;
  split.value()->Split("a\u180Eb \u3000c", pieces);
  CHECK(pieces == std::vector<std::string_view>{"a\u180Eb", " \u3000", "c"});
  pieces.clear();
  auto removed = m3::RegexSplit::Create("-", true, m3::RegexSplit::Behavior::kRemoved, false);
  REQUIRE(removed.ok());
  removed.value()->Split("a-b--c-", pieces);
  CHECK(pieces == std::vector<std::string_view>{"a", "b", "c"});
}

// A minimal valid tokenizer.json to mutate in the refusal tests.
json TinyTokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string s;
    m3::byte_level::AppendUtf8(s, m3::byte_level::ByteToCodePoint(static_cast<uint8_t>(b)));
    vocab[s] = b;
  }
  vocab["ab"] = 256;
  return json{{"version", "1.0"},
              {"added_tokens", json::array({{{"id", 257}, {"content", "<s>"}, {"special", true},
                                             {"normalized", false}, {"lstrip", false},
                                             {"rstrip", false}, {"single_word", false}}})},
              {"normalizer", {{"type", "NFC"}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"a b"})}}}};
}

void RequireRefused(const json& j, StatusCode code, const std::string& fragment) {
  auto r = Tokenizer::FromJson(j.dump(), "tiny/tokenizer.json");
  REQUIRE_FALSE(r.ok());
  INFO(r.status().ToString());
  CHECK(r.status().code() == code);
  CHECK_THAT(r.status().message(), Contains("tiny/tokenizer.json"));
  CHECK_THAT(r.status().message(), Contains(fragment));
}

TEST_CASE("tokenizer: a tiny tokenizer.json works and bad ones are refused", "[tokenizer]") {
  auto ok = Tokenizer::FromJson(TinyTokenizer().dump(), "tiny");
  INFO(ok.status().ToString());
  REQUIRE(ok.ok());
  CHECK(ok.value()->Encode("xab<s>ab") == std::vector<int32_t>({'x', 256, 257, 256}));
  CHECK(ok.value()->Decode(std::vector<int32_t>{256, 257, 'c'}, true) == "abc");
  // Merges in the newer pair format are read too.
  json pairs = TinyTokenizer();
  pairs["model"]["merges"] = json::array({json::array({"a", "b"})});
  auto ok2 = Tokenizer::FromJson(pairs.dump(), "tiny");
  REQUIRE(ok2.ok());
  CHECK(ok2.value()->Encode("ab") == std::vector<int32_t>({256}));

  json j = TinyTokenizer();
  j["model"]["merges"] = json::array({"a c"});
  RequireRefused(j, StatusCode::kCorrupt, "merges[0]");
  j = TinyTokenizer();
  j["model"]["merges"] = json::array({"abc"});
  RequireRefused(j, StatusCode::kCorrupt, "merges[0]");
  j = TinyTokenizer();
  j["normalizer"] = {{"type", "NFKC"}};
  RequireRefused(j, StatusCode::kUnsupported, "NFKC");
  j = TinyTokenizer();
  j["pre_tokenizer"]["use_regex"] = true;
  RequireRefused(j, StatusCode::kUnsupported, "use_regex");
  j = TinyTokenizer();
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers", json::array({{{"type", "Split"},
                                                        {"pattern", {{"Regex", "(unclosed"}}},
                                                        {"behavior", "Removed"},
                                                        {"invert", true}},
                                                       j["pre_tokenizer"]})}};
  RequireRefused(j, StatusCode::kInvalidArgument, "Split pattern");
  j = TinyTokenizer();
  j["model"]["vocab"] = "not an object";
  RequireRefused(j, StatusCode::kCorrupt, "vocab");
  j = TinyTokenizer();
  j["model"].erase("merges");
  RequireRefused(j, StatusCode::kCorrupt, "merges");
  j = TinyTokenizer();
  j["model"]["type"] = "WordPiece";
  RequireRefused(j, StatusCode::kUnsupported, "WordPiece");
  j = TinyTokenizer();
  j["added_tokens"][0]["lstrip"] = true;
  RequireRefused(j, StatusCode::kUnsupported, "<s>");
}

TEST_CASE("tokenizer: missing or corrupt files give an error naming the file", "[tokenizer]") {
  m3::test::TempDir dir;
  auto missing = Tokenizer::Load(dir.str());
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == StatusCode::kNotFound);
  CHECK_THAT(missing.status().message(), Contains(dir.str() + "/tokenizer.json"));

  const std::string path = dir.str() + "/tokenizer.json";
  std::ofstream(path) << R"({"model": {"vocab": {"a": 0}, "merges": [)";  // cut short
  auto corrupt = Tokenizer::Load(path);
  REQUIRE_FALSE(corrupt.ok());
  CHECK(corrupt.status().code() == StatusCode::kCorrupt);
  CHECK_THAT(corrupt.status().message(), Contains(path));

  std::ofstream(path) << "[1, 2, 3]";
  auto not_object = Tokenizer::Load(dir.str());
  REQUIRE_FALSE(not_object.ok());
  CHECK_THAT(not_object.status().message(), Contains(path));
}

// Encode throughput on one core over golden texts repeated to ~3 MB. Not asserted; run with
// `test_tokenizer "[.bench]"`.
TEST_CASE("tokenizer: encode throughput", "[.bench]") {
  const Tokenizer& tok = MiniMax();
  std::string corpus;
  const std::vector<json> cases = Goldens();
  for (int round = 0; corpus.size() < 3'000'000; ++round) {
    for (const json& c : cases) {
      corpus += c["text"].get<std::string>();
      corpus += round % 2 ? "\n" : " ";
    }
  }
  (void)tok.Encode(corpus.substr(0, 100000));  // warm the word cache and the JIT
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = tok.Encode(corpus);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("encode: %.2f MB in %.3f s = %.2f MB/s, %zu tokens\n", corpus.size() / 1e6, s,
              corpus.size() / 1e6 / s, ids.size());
  const auto t1 = std::chrono::steady_clock::now();
  const std::string back = tok.Decode(ids, false);
  const double s2 = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  std::printf("decode: %.2f MB/s\n", back.size() / 1e6 / s2);
  CHECK(!ids.empty());
}

}  // namespace
