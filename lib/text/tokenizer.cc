#include "text/tokenizer.h"
#include "base/json_guard.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uniset.h>

#include "text/bpe.h"
#include "text/byte_level.h"
#include "text/regex_split.h"

namespace m3 {
namespace {

using nlohmann::json;

// Transparent hashing so string_view lookups allocate nothing.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Whole-string matching of added tokens, leftmost first and then longest, like the
// LeftmostLongest Aho-Corasick automaton HF builds. There are few tokens, so candidates are
// bucketed by first byte and compared directly.
class AddedMatcher {
 public:
  void Add(std::string content, int32_t id) {
    if (content.empty()) return;
    auto& bucket = by_first_[static_cast<uint8_t>(content[0])];
    bucket.push_back({std::move(content), id});
    std::stable_sort(bucket.begin(), bucket.end(), [](const Entry& a, const Entry& b) {
      return a.content.size() > b.content.size();
    });
  }
  bool empty() const {
    return std::all_of(by_first_.begin(), by_first_.end(), [](const auto& b) { return b.empty(); });
  }
  // Calls text_fn(piece) for the text between matches and token_fn(id) for each match, in order;
  // a match of bytes [i, i + n) counts only where may_match(i, n).
  template <class TextFn, class TokenFn, class MayMatch>
  void Split(std::string_view text, TextFn&& text_fn, TokenFn&& token_fn, MayMatch&& may_match) const {
    size_t done = 0;
    for (size_t i = 0; i < text.size(); ++i) {
      const auto& bucket = by_first_[static_cast<uint8_t>(text[i])];
      for (const Entry& e : bucket) {
        if (text.compare(i, e.content.size(), e.content) != 0 || !may_match(i, e.content.size())) continue;
        if (i > done) text_fn(text.substr(done, i - done));
        token_fn(e.id);
        done = i + e.content.size();
        i = done - 1;
        break;
      }
    }
    if (done < text.size()) text_fn(text.substr(done));
  }

 private:
  struct Entry {
    std::string content;
    int32_t id;
  };
  std::array<std::vector<Entry>, 256> by_first_;
};

enum class Kind : uint8_t { kNone, kModel, kAdded, kSpecial };

// Bounded memo of pre-token -> ids: words repeat heavily in real text.
class WordCache {
 public:
  bool Get(std::string_view word, std::vector<int32_t>& out) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(word);
    if (it == map_.end()) return false;
    out.insert(out.end(), it->second.begin(), it->second.end());
    return true;
  }
  void Put(std::string_view word, std::span<const int32_t> ids) {
    std::lock_guard<std::mutex> lock(mu_);
    if (map_.size() >= kMaxEntries) map_.clear();  // crude but bounded; refills in one pass
    map_.emplace(std::string(word), std::vector<int32_t>(ids.begin(), ids.end()));
  }
  static constexpr size_t kMaxWordBytes = 256;  // HF's BPE cache skips longer words too

 private:
  static constexpr size_t kMaxEntries = 1 << 16;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map_;
};

const std::string& EmptyString() {
  static const std::string empty;
  return empty;
}

// NFC as HF computes it. HF's unicode-normalization-alignments crate carries Unicode 9.0 data,
// so characters assigned later must pass through untouched (no combining class, no composition);
// ICU's filtered normalizer does exactly that with the set of characters assigned by 9.0.
class Nfc9 {
 public:
  Nfc9() {
    UErrorCode ec = U_ZERO_ERROR;
    const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(ec);
    assigned_ = std::make_unique<icu::UnicodeSet>(icu::UnicodeString(u"[:age=9.0:]"), ec);
    if (U_FAILURE(ec)) return;
    assigned_->freeze();
    norm_ = std::make_unique<icu::FilteredNormalizer2>(*nfc, *assigned_);
  }
  bool ok() const { return norm_ != nullptr; }
  // `s` itself when already normalized (all ASCII, most text), else the normalized copy.
  std::string_view Apply(std::string_view s, std::string& storage) const {
    if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; })) {
      return s;  // ASCII is always NFC
    }
    UErrorCode ec = U_ZERO_ERROR;
    const icu::StringPiece piece(s.data(), static_cast<int32_t>(s.size()));
    if (norm_->isNormalizedUTF8(piece, ec) || U_FAILURE(ec)) return s;
    storage.clear();
    icu::StringByteSink<std::string> sink(&storage);
    ec = U_ZERO_ERROR;
    norm_->normalizeUTF8(0, piece, sink, nullptr, ec);
    return U_FAILURE(ec) ? s : std::string_view(storage);
  }

 private:
  std::unique_ptr<icu::UnicodeSet> assigned_;
  std::unique_ptr<icu::FilteredNormalizer2> norm_;
};

const Nfc9& Nfc() {
  static const Nfc9 nfc;
  return nfc;
}

Status ReadFile(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError("cannot open ", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError("cannot read ", path);
  out = std::move(ss).str();
  return Status::Ok();
}

}  // namespace

struct Tokenizer::Impl {
  std::vector<std::string> spelling;  // by id: vocabulary spelling or added-token content
  std::vector<std::string> bytes;     // by id: what the id decodes to
  std::vector<Kind> kind;             // by id
  StringMap token_to_id;
  std::array<int32_t, 256> byte_id{};  // id of each single-byte symbol, -1 when missing
  MergeTable merges;
  bool nfc = false;
  std::vector<std::unique_ptr<RegexSplit>> splits;  // applied in order
  AddedMatcher raw_added;         // tokens matched before normalization
  AddedMatcher normalized_added;  // tokens matched on normalized text
  mutable WordCache cache;

  Status Build(const json& root);
  void EncodeNormalized(std::string_view text, std::vector<int32_t>& ids) const;
  // `symbols`: the caller's scratch, reused from word to word.
  void EncodeWord(std::string_view word, std::vector<int32_t>& ids, std::vector<int32_t>& symbols) const;
};

namespace {

// Reads the pre-tokenizer, which must end in a plain ByteLevel (our BPE works on bytes).
Status ParsePreTokenizer(const json& pt, std::vector<std::unique_ptr<RegexSplit>>& splits) {
  std::vector<json> steps;
  if (pt.is_object() && pt.value("type", "") == "Sequence") {
    for (const json& s : pt.at("pretokenizers")) steps.push_back(s);
  } else if (!pt.is_null()) {
    steps.push_back(pt);
  }
  if (steps.empty() || steps.back().value("type", "") != "ByteLevel") {
    return Unsupported("pre_tokenizer must end with a ByteLevel step");
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    const json& s = steps[i];
    const std::string type = s.value("type", "");
    if (type == "ByteLevel") {
      if (i + 1 != steps.size()) return Unsupported("pre_tokenizer: ByteLevel must be the last step");
      if (s.value("add_prefix_space", false)) return Unsupported("pre_tokenizer: ByteLevel add_prefix_space");
      if (s.value("use_regex", true)) return Unsupported("pre_tokenizer: ByteLevel use_regex");
    } else if (type == "Split") {
      const json& pattern = s.at("pattern");
      const bool literal = pattern.contains("String");
      const std::string text = literal ? pattern.at("String").get<std::string>()
                                       : pattern.at("Regex").get<std::string>();
      const std::string behavior = s.at("behavior").get<std::string>();
      RegexSplit::Behavior b;
      if (behavior == "Removed") {
        b = RegexSplit::Behavior::kRemoved;
      } else if (behavior == "Isolated") {
        b = RegexSplit::Behavior::kIsolated;
      } else {
        return Unsupported("pre_tokenizer: Split behavior ", behavior);
      }
      auto split = RegexSplit::Create(text, literal, b, s.value("invert", false));
      if (!split.ok()) return Status(split.status().code(), "pre_tokenizer: " + split.status().message());
      splits.push_back(std::move(split).value());
    } else {
      return Unsupported("pre_tokenizer type ", type);
    }
  }
  return Status::Ok();
}

// "a b" (the classic format) or ["a", "b"] (the newer one).
bool MergeParts(const json& m, std::string& a, std::string& b) {
  if (m.is_string()) {
    const std::string& s = m.get_ref<const std::string&>();
    const size_t sp = s.find(' ');
    if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) return false;
    a.assign(s, 0, sp);
    b.assign(s, sp + 1);
    return true;
  }
  if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
    a = m[0].get<std::string>();
    b = m[1].get<std::string>();
    return true;
  }
  return false;
}

}  // namespace

// Ids index dense tables, so a corrupt huge id must not turn into a huge allocation.
constexpr int64_t kMaxId = int64_t{1} << 24;

Status Tokenizer::Impl::Build(const json& root) {
  const json& model = root.at("model");
  if (model.value("type", "BPE") != "BPE") return Unsupported("model type ", model.value("type", ""));
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() != 0.0) {
    return Unsupported("BPE dropout");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return Unsupported("BPE ", key);
    }
  }
  if (model.value("byte_fallback", false)) return Unsupported("BPE byte_fallback");
  if (model.value("ignore_merges", false)) return Unsupported("BPE ignore_merges");

  // Vocabulary.
  const json& vocab = model.at("vocab");
  if (!vocab.is_object()) return Corrupt("model.vocab is not an object");
  auto grow = [&](int32_t id) {
    if (static_cast<size_t>(id) >= spelling.size()) {
      spelling.resize(id + 1);
      bytes.resize(id + 1);
      kind.resize(id + 1, Kind::kNone);
    }
  };
  token_to_id.reserve(vocab.size() + 64);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id >= kMaxId) return Corrupt("model.vocab: id ", id, " of '", it.key(), "' out of range");
    grow(static_cast<int32_t>(id));
    if (kind[id] != Kind::kNone) return Corrupt("model.vocab: id ", id, " used twice");
    kind[id] = Kind::kModel;
    spelling[id] = it.key();
    bytes[id] = byte_level::SpellingToBytes(it.key());
    token_to_id[it.key()] = static_cast<int32_t>(id);
  }
  for (int b = 0; b < 256; ++b) {
    std::string s;
    byte_level::AppendUtf8(s, byte_level::ByteToCodePoint(static_cast<uint8_t>(b)));
    auto it = token_to_id.find(s);
    byte_id[b] = it == token_to_id.end() ? -1 : it->second;
    if (byte_id[b] < 0 && model.contains("unk_token") && !model["unk_token"].is_null()) {
      return Unsupported("vocabulary lacks byte ", b, " and model has an unk_token");
    }
  }

  // Merges, ranked by position; HF refuses merges whose parts or result are not in the vocab.
  const json& merge_list = model.at("merges");
  if (!merge_list.is_array()) return Corrupt("model.merges is not an array");
  merges.Reserve(merge_list.size());
  std::string a, b, ab;
  for (size_t rank = 0; rank < merge_list.size(); ++rank) {
    if (!MergeParts(merge_list[rank], a, b)) return Corrupt("model.merges[", rank, "] is malformed");
    ab.assign(a).append(b);
    auto ia = token_to_id.find(a), ib = token_to_id.find(b), iab = token_to_id.find(ab);
    if (ia == token_to_id.end() || ib == token_to_id.end() || iab == token_to_id.end()) {
      return Corrupt("model.merges[", rank, "] '", a, " ", b, "' uses a token not in the vocabulary");
    }
    merges.Insert(ia->second, ib->second, {static_cast<int32_t>(rank), iab->second});
  }

  // Normalizer.
  const json& norm = root.value("normalizer", json());
  if (!norm.is_null()) {
    if (norm.value("type", "") != "NFC") return Unsupported("normalizer type ", norm.value("type", ""));
    if (!Nfc().ok()) return Status(StatusCode::kInternal, "ICU NFC normalizer unavailable");
    nfc = true;
  }
  M3_RETURN_IF_ERROR(ParsePreTokenizer(root.value("pre_tokenizer", json()), splits));
  const json& dec = root.value("decoder", json());
  if (dec.is_null() || dec.value("type", "") != "ByteLevel") return Unsupported("decoder must be ByteLevel");

  // Added tokens: they take precedence over vocabulary spellings in token_to_id, as in HF.
  for (const json& t : root.value("added_tokens", json::array())) {
    const int64_t id = t.at("id").get<int64_t>();
    const std::string content = t.at("content").get<std::string>();
    if (id < 0 || id >= kMaxId) return Corrupt("added token '", content, "': id out of range");
    if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false)) {
      return Unsupported("added token '", content, "': lstrip/rstrip/single_word");
    }
    const bool special = t.value("special", false);
    grow(static_cast<int32_t>(id));
    kind[id] = special ? Kind::kSpecial : Kind::kAdded;
    spelling[id] = content;
    bytes[id] = content;
    token_to_id[content] = static_cast<int32_t>(id);
    if (t.value("normalized", !special)) {
      std::string storage;
      normalized_added.Add(std::string(nfc ? Nfc().Apply(content, storage) : content), static_cast<int32_t>(id));
    } else {
      raw_added.Add(content, static_cast<int32_t>(id));
    }
  }
  return Status::Ok();
}

void Tokenizer::Impl::EncodeWord(std::string_view word, std::vector<int32_t>& ids,
                                 std::vector<int32_t>& symbols) const {
  if (word.size() == 1) {
    if (byte_id[static_cast<uint8_t>(word[0])] >= 0) ids.push_back(byte_id[static_cast<uint8_t>(word[0])]);
    return;
  }
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache.Get(word, ids)) return;
  symbols.clear();
  for (char c : word) {
    // A byte without a vocabulary symbol is dropped, as HF's BPE does without an unk_token.
    if (byte_id[static_cast<uint8_t>(c)] >= 0) symbols.push_back(byte_id[static_cast<uint8_t>(c)]);
  }
  BpeMerge(merges, symbols);
  if (cacheable) cache.Put(word, symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
}

void Tokenizer::Impl::EncodeNormalized(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<std::string_view> pieces{text}, next;
  RegexMatchState match;
  for (const auto& split : splits) {
    next.clear();
    for (std::string_view p : pieces) split->Split(p, next, match);
    pieces.swap(next);
  }
  std::vector<int32_t> symbols;
  for (std::string_view p : pieces) EncodeWord(p, ids, symbols);
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path_or_dir) {
  std::error_code ec;
  std::string path = path_or_dir;
  if (std::filesystem::is_directory(path, ec)) path = (std::filesystem::path(path) / "tokenizer.json").string();
  if (!std::filesystem::exists(path, ec)) return NotFound("tokenizer file not found: ", path);
  std::string text;
  M3_RETURN_IF_ERROR(ReadFile(path, text));
  return FromJson(text, path);
}

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text, const std::string& source) {
  auto impl = std::make_unique<Impl>();
  if (Status depth = CheckJsonDepth(json_text, source); !depth.ok()) return Corrupt(depth.message());
  try {
    const json root = json::parse(json_text);
    if (!root.is_object()) return Corrupt(source, ": top level is not a JSON object");
    Status st = impl->Build(root);
    if (!st.ok()) return Status(st.code(), source + ": " + st.message());
  } catch (const json::exception& e) {
    // Parse errors and missing or mistyped fields alike.
    return Corrupt(source, ": malformed tokenizer JSON: ", e.what());
  } catch (const std::exception& e) {
    return Internal(source, ": ", e.what());
  }
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text) const { return Encode(text, {}); }

std::vector<int32_t> Tokenizer::Encode(std::string_view text, std::span<const std::pair<size_t, size_t>> literal) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  // HF only ever sees valid strings; invalid input is repaired the way from_utf8_lossy would.
  std::string repaired;
  if (!byte_level::IsValidUtf8(text)) {
    byte_level::AppendLossyUtf8(repaired, text, false);
    text = repaired;
    literal = {};  // its offsets no longer hold (callers pass valid text)
  }
  // Whether bytes [i, i + n) of `text` stay clear of the literal ranges.
  auto outside_literal = [&](size_t i, size_t n) {
    for (const auto& [begin, end] : literal)
      if (i < end && begin < i + n) return false;
    return true;
  };
  const Impl& m = *impl_;
  std::string storage;
  auto encode_plain = [&](std::string_view piece) {
    const std::string_view normalized = m.nfc ? Nfc().Apply(piece, storage) : piece;
    if (m.normalized_added.empty()) {
      m.EncodeNormalized(normalized, ids);
      return;
    }
    // (Offsets in normalized text are not the input's: a piece touching a literal range has its
    // normalized added tokens matched nowhere.)
    const bool may = literal.empty() || outside_literal(static_cast<size_t>(piece.data() - text.data()), piece.size());
    m.normalized_added.Split(
        normalized, [&](std::string_view p) { m.EncodeNormalized(p, ids); }, [&](int32_t id) { ids.push_back(id); },
        [may](size_t, size_t) { return may; });
  };
  m.raw_added.Split(text, encode_plain, [&](int32_t id) { ids.push_back(id); }, outside_literal);
  return ids;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  // HF (tokenizers >= 0.21) byte-decodes the runs of model tokens and inserts added tokens
  // verbatim between them; each run is repaired to UTF-8 on its own.
  std::string out, run;
  for (int32_t id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= impl_->kind.size()) continue;
    const Kind k = impl_->kind[id];
    if (k == Kind::kNone || (k == Kind::kSpecial && skip_special_tokens)) continue;
    if (k == Kind::kModel) {
      run += impl_->bytes[id];
      continue;
    }
    byte_level::AppendLossyUtf8(out, run, false);
    run.clear();
    out += impl_->bytes[id];
  }
  byte_level::AppendLossyUtf8(out, run, false);
  return out;
}

int32_t Tokenizer::TokenId(std::string_view token) const {
  auto it = impl_->token_to_id.find(token);
  return it == impl_->token_to_id.end() ? -1 : it->second;
}

const std::string& Tokenizer::TokenString(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->spelling.size()) return EmptyString();
  return impl_->spelling[id];
}

const std::string& Tokenizer::TokenBytes(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= impl_->bytes.size()) return EmptyString();
  return impl_->bytes[id];
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->kind.size() && impl_->kind[id] == Kind::kSpecial;
}

bool Tokenizer::IsAdded(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->kind.size() &&
         (impl_->kind[id] == Kind::kAdded || impl_->kind[id] == Kind::kSpecial);
}

size_t Tokenizer::vocab_size() const { return impl_->kind.size(); }

std::string StreamingDecoder::Push(int32_t id) {
  std::string out;
  if (id < 0 || static_cast<size_t>(id) >= tokenizer_.vocab_size()) return out;
  if (tokenizer_.IsAdded(id)) {
    if (skip_special_ && tokenizer_.IsSpecial(id)) return out;
    // An added token ends the byte run: an unfinished character before it is settled as U+FFFD.
    byte_level::AppendLossyUtf8(out, pending_, false);
    pending_.clear();
    out += tokenizer_.TokenBytes(id);
    return out;
  }
  pending_ += tokenizer_.TokenBytes(id);
  const size_t used = byte_level::AppendLossyUtf8(out, pending_, true);
  pending_.erase(0, used);
  return out;
}

std::string StreamingDecoder::Flush() {
  std::string out;
  byte_level::AppendLossyUtf8(out, pending_, false);
  pending_.clear();
  return out;
}

}  // namespace m3
