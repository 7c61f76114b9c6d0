#include "text/regex_split.h"

#include "text/onig_compat.h"

#include <new>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace m3 {
namespace {

pcre2_code* Code(void* p) { return static_cast<pcre2_code*>(p); }

// Length of the UTF-8 character that starts with `b` (1 for a stray byte, to keep moving).
size_t CharLen(unsigned char b) { return b < 0xC0 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

}  // namespace

RegexMatchState::RegexMatchState() : md_(pcre2_match_data_create(1, nullptr)) {
  if (!md_) throw std::bad_alloc();
}
RegexMatchState::~RegexMatchState() { pcre2_match_data_free(static_cast<pcre2_match_data*>(md_)); }

StatusOr<std::unique_ptr<RegexSplit>> RegexSplit::Create(const std::string& pattern, bool literal,
                                                         Behavior behavior, bool invert) {
  std::string translated = pattern;
  if (!literal) {
    auto t = OnigPatternToPcre2(pattern);
    if (!t.ok()) return Status(t.status().code(), "Split pattern: " + t.status().message());
    translated = std::move(t).value();
  }
  int error = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2 refuses UCP together with LITERAL (it has no effect there anyway).
  const uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                   translated.size(), options, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(error, msg, sizeof(msg));
    return InvalidArgument("Split pattern does not compile (at offset ", offset, " of the PCRE2 form): ",
                           reinterpret_cast<const char*>(msg));
  }
  // JIT is an optimisation only: when it is unavailable pcre2_match interprets the pattern.
  (void)pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  std::unique_ptr<RegexSplit> split(new RegexSplit());
  split->code_ = code;
  split->behavior_ = behavior;
  split->invert_ = invert;
  return split;
}

RegexSplit::~RegexSplit() { pcre2_code_free(Code(code_)); }

void RegexSplit::Split(std::string_view text, std::vector<std::string_view>& pieces, RegexMatchState& state) const {
  // A segment is dropped only under kRemoved when it counts as a match (after `invert`).
  auto emit = [&](size_t begin, size_t end, bool is_match) {
    if (end <= begin) return;
    if (behavior_ == Behavior::kRemoved && (is_match != invert_)) return;
    pieces.push_back(text.substr(begin, end - begin));
  };
  auto* md = static_cast<pcre2_match_data*>(state.data());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t prev = 0;   // end of the last match
  size_t start = 0;  // where the next search begins
  while (start <= text.size()) {
    int rc = pcre2_match(Code(code_), subject, text.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
      // The JIT's small default stack ran out on a long run: the interpreter keeps its
      // backtracking state on the heap and gets much further.
      rc = pcre2_match(Code(code_), subject, text.size(), start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       md, nullptr);
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      // A resource limit even so: keep the rest whole rather than lose text.
      pieces.push_back(text.substr(prev));
      return;
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t begin = ov[0], end = ov[1];
    emit(prev, begin, false);
    emit(begin, end, true);
    prev = end;
    // After an empty match step over one character, as Oniguruma's find_iter does.
    start = end > begin ? end : end + (end < text.size() ? CharLen(static_cast<unsigned char>(text[end])) : 1);
  }
  emit(prev, text.size(), false);
}

}  // namespace m3
