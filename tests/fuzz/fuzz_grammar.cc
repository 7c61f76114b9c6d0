// Grammars from untrusted text (lib/constrain): the first byte picks GBNF, a JSON schema, or a
// tool list (JSON: [{"name","parameters"}]); the rest is compiled, and when it compiles, a short
// random walk (seeded by the input) drives a Matcher over a small vocabulary of single bytes and a
// few multi-byte tokens, checking that every mask is non-empty and every allowed token accepted.
#include <cstdio>

#include <nlohmann/json.hpp>

#include "base/json_guard.h"
#include "constrain/constrain.h"
#include "constrain/grammar.h"
#include "text/tokenizer.h"

namespace {

// A byte-level tokenizer with 256 byte tokens, some merges, and the M3 markup and end tokens.
const m3::Tokenizer& SmallTokenizer() {
  static const std::unique_ptr<m3::Tokenizer> tok = [] {
    nlohmann::json vocab = nlohmann::json::object();
    // ByteLevel's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    int next = 0;
    std::vector<std::string> spell(256);
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      const uint32_t cp = printable ? uint32_t(b) : uint32_t(256 + next++);
      std::string u;
      if (cp < 0x80) {
        u += char(cp);
      } else {
        u += char(0xC0 | (cp >> 6));
        u += char(0x80 | (cp & 0x3F));
      }
      spell[b] = u;
      vocab[u] = b;
    }
    nlohmann::json merges = nlohmann::json::array();
    int id = 256;
    for (const char* m : {"\" :", "\": \"", "t r", "tr u", "tru e", "n u", "nu l", "nul l", "{ \"", "\" }", "[ ]"}) {
      std::string a(m), left = a.substr(0, a.find(' ')), right = a.substr(a.find(' ') + 1);
      merges.push_back(a);
      vocab[left + right] = id++;
    }
    nlohmann::json added = nlohmann::json::array();
    for (const char* t : {"]<]minimax[>[", "<tool_call>", "</tool_call>", "[e~["}) {
      added.push_back({{"id", id++}, {"content", t}, {"special", true}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", false}});
    }
    const nlohmann::json j = {
        {"version", "1.0"},
        {"added_tokens", added},
        {"normalizer", nullptr},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}},
        {"post_processor", nullptr},
        {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
        {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
                   {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"vocab", vocab},
                   {"merges", merges}}}};
    auto t = m3::Tokenizer::FromJson(j.dump(), "fuzz tokenizer");
    if (!t.ok()) {
      std::fprintf(stderr, "fuzz_grammar: %s\n", t.status().message().c_str());
      __builtin_trap();
    }
    return std::move(*t);
  }();
  return *tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  static const auto vocab = m3::constrain::VocabIndex::Build(SmallTokenizer());
  static const auto markup = m3::constrain::MarkupTokens::From(SmallTokenizer());
  if (!markup.ok()) __builtin_trap();
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  m3::StatusOr<std::shared_ptr<const m3::constrain::Grammar>> g = m3::InvalidArgument("none");
  switch (data[0] % 3) {
    case 0:
      g = m3::constrain::CompileGbnf(text);
      break;
    case 1: {
      auto j = m3::ParseJson<nlohmann::json>(text, "schema");
      if (!j.ok()) return 0;
      g = m3::constrain::CompileJsonSchema(*j);
      break;
    }
    default: {
      auto j = m3::ParseJson<nlohmann::json>(text, "tools");
      if (!j.ok() || !j->is_array()) return 0;
      std::vector<m3::constrain::ToolSpec> tools;
      for (const auto& t : *j) {
        if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) return 0;
        tools.push_back({t["name"].get<std::string>(), t.value("parameters", nlohmann::json())});
      }
      g = m3::constrain::CompileToolCalls(tools, *markup, data[0] & 4);
      break;
    }
  }
  if (!g.ok()) {
    if (g.status().message().empty()) __builtin_trap();  // errors always say what is wrong
    return 0;
  }
  const int32_t end_id = SmallTokenizer().TokenId("[e~[");
  m3::constrain::Matcher m(*g, vocab, {end_id});
  std::vector<uint64_t> mask(m.mask_words());
  uint32_t seed = 2166136261u;
  for (size_t i = 0; i < size; ++i) seed = (seed ^ data[i]) * 16777619u;
  const size_t budget = 64;
  if (m.MinTokens() > budget) return 0;
  for (size_t left = budget; left > 0 && !m.done(); --left) {
    m.FillMask(mask, left);
    std::vector<int32_t> allowed;
    for (size_t w = 0; w < mask.size(); ++w) {
      for (uint64_t bits = mask[w]; bits; bits &= bits - 1) allowed.push_back(int32_t(w * 64 + __builtin_ctzll(bits)));
    }
    if (allowed.empty()) __builtin_trap();  // never an empty mask
    seed = seed * 1103515245u + 12345u;
    if (!m.Accept(allowed[(seed >> 8) % allowed.size()])) __builtin_trap();  // allowed means accepted
  }
  // Within a budget of at least MinTokens() the walk always completes (unless the grammar names a
  // token the vocabulary lacks, which CheckGrammarTokens reports).
  if (!m.done() && m3::constrain::CheckGrammarTokens(**g, *vocab).ok()) __builtin_trap();
  return 0;
}
