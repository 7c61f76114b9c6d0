// Byte-level BPE tokenizer read from a HuggingFace tokenizer.json, matching the `tokenizers`
// library (encode with add_special_tokens=false, decode) id for id and byte for byte.
//
// Supported pipeline (anything else is refused at Load with kUnsupported):
//   added tokens (lstrip/rstrip/single_word off), normalizer null or NFC, pre-tokenizer made of
//   Split (Regex or String pattern, behavior Removed or Isolated, any invert) and ByteLevel
//   (use_regex false, add_prefix_space false), BPE model without dropout, suffixes or byte
//   fallback, decoder ByteLevel. The post-processor is ignored: it only acts when special tokens
//   are added, and Encode never adds them.
//
// Unicode versions follow HF's, not the system libraries': NFC uses Unicode 9.0 data (ICU
// filtered to characters assigned by 9.0, as HF's normalization crate), and the Split regex
// sees Oniguruma's Unicode 16.0 categories (see onig_compat.h).
//
// Defined behaviour where HF has none (it only ever sees valid Rust strings):
//   - Encode replaces each invalid UTF-8 sequence of its input with U+FFFD first, by the same
//     maximal-subpart rule as Rust's String::from_utf8_lossy, then encodes as HF would.
//   - Decode skips ids that are neither in the vocabulary nor added tokens, as HF does.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"

namespace m3 {

class Tokenizer {
 public:
  // `path_or_dir`: a tokenizer.json file, or a folder that holds one. Errors name the file.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path_or_dir);
  // Same, from the JSON text itself; `source` names it in error messages.
  static StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text,
                                                       const std::string& source);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // HF encode(text, add_special_tokens=false). Thread-safe.
  std::vector<int32_t> Encode(std::string_view text) const;
  // Same, but no added token is matched that overlaps one of the byte ranges [begin, end) of
  // `literal`: text there (a user's message, say) is encoded as plain text even where it spells
  // "<mm:think>". The ranges hold for valid UTF-8 (invalid input is repaired and they are dropped).
  std::vector<int32_t> Encode(std::string_view text, std::span<const std::pair<size_t, size_t>> literal) const;
  // HF decode(ids, skip_special_tokens): invalid UTF-8 from partial byte tokens becomes U+FFFD.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Id of a vocabulary spelling ("Ġworld") or added token ("<think>"), or -1.
  int32_t TokenId(std::string_view token) const;
  // Vocabulary spelling or added-token content of `id`; empty for an unknown id.
  const std::string& TokenString(int32_t id) const;
  // The bytes `id` decodes to (its added-token content for added tokens); empty when unknown.
  const std::string& TokenBytes(int32_t id) const;
  bool IsSpecial(int32_t id) const;
  bool IsAdded(int32_t id) const;
  // One past the highest id, added tokens included (HF get_vocab_size(with_added_tokens=true)
  // when ids are dense, as they are for MiniMax-M3: 200,061).
  size_t vocab_size() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Decodes ids one at a time for streaming output. Pushing every id and then calling Flush yields
// exactly Decode(all ids, skip_special_tokens), and every returned piece is valid UTF-8: bytes
// that may still complete a character are held back until the next id settles them.
class StreamingDecoder {
 public:
  explicit StreamingDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false)
      : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

  // The text that `id` completes (often empty while a multi-byte character is pending).
  std::string Push(int32_t id);
  // The held-back tail, with an unfinished character replaced by U+FFFD; resets the decoder.
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_;  // bytes of an unfinished UTF-8 sequence
};

}  // namespace m3
