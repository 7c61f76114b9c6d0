// GPT-2 byte-level helpers shared by the tokenizer: the byte <-> printable-code-point map used in
// vocabulary spellings (byte 0x20 is written U+0120 "Ġ"), and UTF-8 repair that reproduces Rust's
// String::from_utf8_lossy exactly, since HF decode goes through it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace m3::byte_level {

// Code point that spells `byte` in a byte-level vocabulary (GPT-2 bytes_to_unicode).
char32_t ByteToCodePoint(uint8_t byte);

// Inverse of ByteToCodePoint: the byte, or -1 when `cp` spells no byte.
int CodePointToByte(char32_t cp);

// Appends the UTF-8 encoding of `cp` (caller guarantees a Unicode scalar value).
void AppendUtf8(std::string& out, char32_t cp);

// Decodes the code point starting at s[*pos] from valid UTF-8 and advances *pos.
char32_t NextCodePoint(std::string_view s, size_t* pos);

// The raw bytes a vocabulary spelling stands for, as HF's ByteLevel decoder computes them: every
// code point mapped back to its byte, or, when any code point spells no byte (an added token with
// a space, say), the spelling's own UTF-8 bytes unchanged.
std::string SpellingToBytes(std::string_view spelling);

// Appends `bytes` to `out` with each invalid sequence replaced by one U+FFFD, using the "maximal
// subpart" rule of Rust's from_utf8_lossy (core::str::Utf8Chunks). When `hold_incomplete_tail`
// is set, a trailing sequence that is a valid but unfinished prefix of a character is left out
// instead of being replaced. Returns the number of bytes consumed (bytes.size() unless held).
size_t AppendLossyUtf8(std::string& out, std::string_view bytes, bool hold_incomplete_tail);

// True when `s` is well-formed UTF-8.
bool IsValidUtf8(std::string_view s);

}  // namespace m3::byte_level
