#include "text/byte_level.h"

#include <array>

namespace m3::byte_level {
namespace {

// Printable bytes keep their own code point; the other 68 take 256, 257, ... in byte order.
struct ByteMaps {
  std::array<char32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // every mapped code point is below 256 + 68
  ByteMaps() {
    to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_cp[b] = printable ? static_cast<char32_t>(b) : next++;
      to_byte[to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};

const ByteMaps& Maps() {
  static const ByteMaps maps;
  return maps;
}

// One step of Rust's Utf8Chunks over s[pos..]: how many bytes the step takes, whether they form a
// character, and whether it failed only because the input ended inside a valid prefix.
struct Step {
  size_t len;
  bool valid;
  bool truncated;
};

Step DecodeStep(std::string_view s, size_t pos) {
  const size_t n = s.size();
  const uint8_t first = static_cast<uint8_t>(s[pos]);
  if (first < 0x80) return {1, true, false};
  auto at = [&](size_t k) -> int { return pos + k < n ? static_cast<uint8_t>(s[pos + k]) : -1; };
  auto cont = [](int b) { return b >= 0x80 && b <= 0xBF; };
  int width = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (first >= 0xC2 && first <= 0xDF) {
    width = 2;
  } else if (first >= 0xE0 && first <= 0xEF) {
    width = 3;
    if (first == 0xE0) lo = 0xA0;  // overlong
    if (first == 0xED) hi = 0x9F;  // surrogates
  } else if (first >= 0xF0 && first <= 0xF4) {
    width = 4;
    if (first == 0xF0) lo = 0x90;  // overlong
    if (first == 0xF4) hi = 0x8F;  // above U+10FFFF
  } else {
    return {1, false, false};
  }
  for (int k = 1; k < width; ++k) {
    const int b = at(k);
    if (b < 0) return {static_cast<size_t>(k), false, true};
    const bool ok = k == 1 ? (b >= lo && b <= hi) : cont(b);
    if (!ok) return {static_cast<size_t>(k), false, false};
  }
  return {static_cast<size_t>(width), true, false};
}

}  // namespace

char32_t ByteToCodePoint(uint8_t byte) { return Maps().to_cp[byte]; }

int CodePointToByte(char32_t cp) {
  return cp < Maps().to_byte.size() ? Maps().to_byte[cp] : -1;
}

void AppendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

char32_t NextCodePoint(std::string_view s, size_t* pos) {
  const uint8_t b0 = static_cast<uint8_t>(s[*pos]);
  int extra = b0 < 0x80 ? 0 : b0 < 0xE0 ? 1 : b0 < 0xF0 ? 2 : 3;
  char32_t cp = extra == 0 ? b0 : extra == 1 ? (b0 & 0x1F) : extra == 2 ? (b0 & 0x0F) : (b0 & 0x07);
  ++*pos;
  for (; extra > 0 && *pos < s.size(); --extra, ++*pos) {
    cp = (cp << 6) | (static_cast<uint8_t>(s[*pos]) & 0x3F);
  }
  return cp;
}

std::string SpellingToBytes(std::string_view spelling) {
  std::string bytes;
  bytes.reserve(spelling.size());
  for (size_t pos = 0; pos < spelling.size();) {
    const int b = CodePointToByte(NextCodePoint(spelling, &pos));
    if (b < 0) return std::string(spelling);
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

size_t AppendLossyUtf8(std::string& out, std::string_view bytes, bool hold_incomplete_tail) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    // Copy the ASCII run in one go: the common case.
    size_t run = pos;
    while (run < bytes.size() && static_cast<uint8_t>(bytes[run]) < 0x80) ++run;
    out.append(bytes.data() + pos, run - pos);
    pos = run;
    if (pos == bytes.size()) break;
    const Step step = DecodeStep(bytes, pos);
    if (step.valid) {
      out.append(bytes.data() + pos, step.len);
    } else if (step.truncated && hold_incomplete_tail) {
      return pos;
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
    }
    pos += step.len;
  }
  return pos;
}

bool IsValidUtf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const Step step = DecodeStep(s, pos);
    if (!step.valid) return false;
    pos += step.len;
  }
  return true;
}

}  // namespace m3::byte_level
