// Constrained decoding: a grammar (GBNF, a JSON schema, or M3's tool-call markup) turned into a
// token mask over the vocabulary at each decode step.
//
//   Grammar     compiled, immutable, shared between threads and requests (grammar.h holds its IR).
//   VocabIndex  every text token's bytes in a byte trie, built once per tokenizer and shared.
//   Matcher     one request's parse state: the mask of the tokens that may come next, Accept.
//
// The engine works on bytes (every byte is a token of the byte-level BPE vocabulary), as a set of
// parse stacks (llama.cpp's llama-grammar idea) whose transitions are memoized per Matcher as a
// lazy DFA; a mask is one walk of the vocabulary trie, pruned at the first rejected byte, and is
// cached per parse state, in the matcher and in the grammar (shared by the requests that use it,
// thread-safe). docs/CONSTRAIN.md has the design and the measured costs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status.h"
#include "constrain/budget.h"
#include "text/tokenizer.h"

namespace m3::constrain {

class Grammar;  // constrain/grammar.h

// GBNF as llama.cpp writes it: `name ::= alternatives` rules (root rule "root"), "literals",
// [^a-z\n] classes, `.`, groups, `|`, `*` `+` `?` `{m}` `{m,}` `{m,n}`, `#` comments, rule
// references, and <[123]> token-id terminals (special tokens, never matched by text).
// Errors (InvalidArgument) name the line and what is wrong; left recursion is refused.
StatusOr<std::shared_ptr<const Grammar>> CompileGbnf(std::string_view text, const CompileBudget& budget = {});

// A compact JSON value (no optional whitespace) valid against `schema`; see json_schema.cc for the
// supported subset. An unsupported keyword that would change validity is refused
// (InvalidArgument naming the keyword and its JSON path, e.g. "/properties/a/not").
StatusOr<std::shared_ptr<const Grammar>> CompileJsonSchema(const nlohmann::json& schema, const CompileBudget& budget = {});

// response_format {"type": "json_object"}: any JSON object (compact).
std::shared_ptr<const Grammar> AnyJsonObject();

// M3's tool-call markup (spec/CHAT_FORMAT.md §4): one block
//   NS <tool_call> "\n" invoke+ NS </tool_call>
// whose invokes call the given tools with arguments that lib/text/output_parser reads back as
// JSON valid against each tool's `parameters` (tool_calls.cc lists the rules).
struct ToolSpec {
  std::string name;
  nlohmann::json parameters;  // a JSON schema of type object (null: no parameters)
};
struct MarkupTokens {
  int32_t ns = -1;              // "]<]minimax[>["
  int32_t tool_call_open = -1;  // "<tool_call>"
  int32_t tool_call_close = -1; // "</tool_call>"
  static StatusOr<MarkupTokens> From(const Tokenizer& tokenizer);
};
StatusOr<std::shared_ptr<const Grammar>> CompileToolCalls(std::span<const ToolSpec> tools, const MarkupTokens& t,
                                                          bool single_call = false, const CompileBudget& budget = {});

// Each text token's bytes in a byte trie (added and special tokens are left out: only <[id]>
// terminals match them). Immutable; build once per tokenizer.
class VocabIndex {
 public:
  static std::shared_ptr<const VocabIndex> Build(const Tokenizer& tokenizer);
  // One past the highest token id (the mask's bit count).
  size_t vocab_size() const { return vocab_size_; }
  // Nodes of the trie, in preorder (for the report: ~ bytes of all text tokens, shared prefixes once).
  size_t trie_nodes() const { return byte_.size(); }
  const std::string& token_bytes(int32_t id) const;
  bool is_text_token(int32_t id) const;

 private:
  friend class Matcher;
  size_t vocab_size_ = 0;
  uint64_t uid_ = 0;  // unique per index built (keys the grammars' shared masks)
  // Preorder trie: node i has byte_[i] at depth depth_[i] (1 = first byte); skip_[i] is the
  // index just past its subtree; token_[i] the id whose bytes end there (-1: none).
  std::vector<uint8_t> byte_;
  std::vector<uint16_t> depth_;
  std::vector<uint32_t> skip_;
  std::vector<int32_t> token_;
  std::vector<std::pair<uint32_t, int32_t>> duplicates_;  // (node, another id with the same bytes)
  std::vector<std::string> bytes_;  // by id; empty for added tokens and unknown ids
  std::vector<uint8_t> text_;       // by id: 1 for a text token
  size_t max_depth_ = 0;
};

// InvalidArgument naming the first <[id]> terminal of `g` that `v` lacks (ids past its size):
// such a terminal can never be matched. Call it once per (grammar, tokenizer) for GBNF from users.
Status CheckGrammarTokens(const Grammar& g, const VocabIndex& v);

// One request's state. Not thread-safe; cheap to create (its caches fill as it runs).
class Matcher {
 public:
  // end_ids: the ids that end the turn; allowed exactly when the grammar is complete.
  Matcher(std::shared_ptr<const Grammar> g, std::shared_ptr<const VocabIndex> v, std::vector<int32_t> end_ids);
  ~Matcher();
  Matcher(Matcher&&) noexcept;
  Matcher& operator=(Matcher&&) noexcept;
  // A copy of the state (the caches are not copied). For tests and look-ahead.
  Matcher Clone() const;

  // Bit i of `mask` (at least vocab_size bits; bits past it are cleared) set iff token i may come
  // next. `tokens_left`: the remaining budget including this token; when it is tight, only tokens
  // after which the grammar can still be completed, end id included, within it are allowed.
  // Never empty while !done() (past a budget below MinTokens() it falls back to the unbudgeted mask).
  void FillMask(std::span<uint64_t> mask, size_t tokens_left);
  bool Accept(int32_t id);   // advances; false (state unchanged) if id is not allowed now
  bool complete() const;     // the grammar accepts what was accepted so far
  bool done() const;         // an end id was accepted
  size_t MinTokens() const;  // fewest tokens that complete the grammar from here, end id included
  // OK, or why the matcher cannot follow the grammar from its start: the first position passes
  // a bound of one parse state (more than 1,024 stacks at once, rules nested deeper than 512, or
  // over 50,000 positions expanded), named in the error.
  Status StartStatus() const;
  // Sets the logits of disallowed tokens (and of ids past vocab_size) to -infinity.
  void ApplyMask(std::span<float> logits, size_t tokens_left);

  size_t mask_words() const;  // uint64 words FillMask needs
  struct Stats {
    // masks asked for; of them found in this matcher's cache, in the grammar's shared cache;
    // vocabulary walks made (the rest); the matcher's lazy-DFA states and stack nodes.
    size_t masks = 0, cached = 0, shared = 0, trie_walks = 0, dfa_states = 0, stack_nodes = 0;
  };
  Stats stats() const;

 private:
  struct Impl;
  explicit Matcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::constrain
