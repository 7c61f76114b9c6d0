// MiniMax-M3 output text -> OpenAI `reasoning_content`, `content` and `tool_calls`
// (docs/MODEL.md §6.3 and §6.4), on finished text and incrementally.
//
// Reasoning: `<mm:think>` ... `</mm:think>`. The caller says whether the prompt already opened the
// block (thinking_mode "enabled" ends the prompt with `<mm:think>`): ThinkState::kInside. Otherwise
// the first bytes decide: a leading `</mm:think>` is dropped, a leading `<mm:think>` opens
// reasoning, anything else is content. When the prompt did not open the block, one `<mm:think>`
// later in the content still opens a reasoning span (vLLM behaviour); a stray `</mm:think>` in
// content stays visible. An unterminated reasoning block is all reasoning.
//
// Tool calls: `]<]minimax[>[<tool_call>` ... `]<]minimax[>[</tool_call>` blocks in the content,
// each holding one or more `<invoke name="f">` elements whose child elements are the arguments,
// typed by the tool's JSON schema. A block that does not match the grammar, or never closes, is
// returned verbatim as content. Think markers inside a tool block are plain text.
//
// Nothing here throws or aborts on any input bytes.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace m3 {

struct ToolCall {
  std::string id;    // id_prefix + index of the call within this output ("call_0", "call_1", ...)
  std::string name;  // function name as written by the model (not checked against `tools`)
  // Always an object. ordered_json keeps the model's key order, as Python-based servers do.
  nlohmann::ordered_json arguments;
};

struct ParsedOutput {
  std::string reasoning;  // empty: no reasoning_content (null)
  std::string content;    // empty: no content (null)
  std::vector<ToolCall> tool_calls;
};

// Where the model's output starts: inside reasoning when the prompt ended with `<mm:think>`.
enum class ThinkState { kOutside, kInside };

// Parses a finished output. `tools` is the request's OpenAI tools array (entries
// {"type":"function","function":{"name","parameters"}} or bare {"name","parameters"}); null or
// anything else means no schemas, so every leaf argument stays a string.
ParsedOutput ParseOutput(std::string_view text, ThinkState initial, const nlohmann::json& tools,
                         std::string_view id_prefix = "call_");

// `function.arguments` text the way SGLang/vLLM write it: json.dumps with ", " and ": "
// separators and non-ASCII kept. Invalid UTF-8 (impossible for parsed calls) becomes U+FFFD.
std::string SerializeArguments(const nlohmann::ordered_json& arguments);

// Incremental parser over text pieces split anywhere (inside a tag or a UTF-8 character).
// It holds back a tail that may still become markup and an incomplete UTF-8 character, so every
// emitted piece of valid input is valid UTF-8 and nothing emitted is later found to be markup.
// A tool block is held until it closes; its calls come out together in that delta.
// The concatenation of all deltas (Push... then Finish) equals ParseOutput of the whole text.
class StreamingOutputParser {
 public:
  struct Delta {
    std::string reasoning;
    std::string content;
    std::vector<ToolCall> tool_calls;  // completed calls
    bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
  };

  explicit StreamingOutputParser(ThinkState initial, nlohmann::json tools = nullptr,
                                 std::string id_prefix = "call_");

  Delta Push(std::string_view text_piece);
  // End of generation: flushes held text (an open think block as reasoning, an open tool block
  // as content). Later Push/Finish calls return empty deltas.
  Delta Finish();

 private:
  enum class Mode { kStart, kReasoning, kContent, kToolBlock };

  void Process(bool final, Delta& out);
  bool StepStart(bool final);
  bool StepReasoning(bool final, Delta& out);
  bool StepContent(bool final, Delta& out);
  bool StepToolBlock(bool final, Delta& out);
  void CloseToolBlock(size_t block_end, Delta& out);
  // Channel output goes through these so an incomplete UTF-8 tail waits for its next bytes.
  void EmitReasoning(std::string_view text, Delta& out);
  void EmitContent(std::string_view text, Delta& out);

  nlohmann::json tools_;
  std::string id_prefix_;
  Mode mode_;
  bool think_reopen_allowed_;  // a `<mm:think>` in content may still open the one reasoning span
  bool finished_ = false;
  std::string pending_;           // unprocessed input
  std::string block_;             // raw text of the open tool block, opener included
  size_t block_opener_size_ = 0;  // length of the opener at the start of block_
  size_t block_scan_from_ = 0;    // block_ before this offset cannot start the closer
  std::string reasoning_utf8_tail_;
  std::string content_utf8_tail_;
  size_t next_call_index_ = 0;
};

}  // namespace m3
