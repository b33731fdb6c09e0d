// UTF-8 decoding and the Unicode character classes the tokenizers' pre-tokenizers need
// (\p{L}, \p{N}, \s as Unicode-aware regex engines define them).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace focus::io::unicode {

// Major general category of a code point.
enum Category : uint8_t { kOther = 0, kLetter, kMark, kNumber, kPunct, kSymbol, kSeparator };

// Returned by decode_utf8 for a byte that does not start a valid sequence.
inline constexpr uint32_t kInvalid = 0xFFFFFFFFu;

// Decodes the code point starting at s[pos]; sets len to the bytes it takes (>= 1).
// Malformed, overlong, surrogate or out-of-range sequences give kInvalid with len = 1.
uint32_t decode_utf8(std::string_view s, size_t pos, size_t& len);

// Length of the UTF-8 sequence starting at s[pos] (1 for an invalid byte).
inline size_t utf8_len(std::string_view s, size_t pos) {
  const unsigned char c = (unsigned char)s[pos];
  if (c < 0x80) return 1;
  size_t len;
  decode_utf8(s, pos, len);
  return len;
}

void append_utf8(std::string& out, uint32_t cp);
bool is_valid_utf8(std::string_view s);

Category category(uint32_t cp);  // kOther for kInvalid
bool is_whitespace(uint32_t cp);  // White_Space property
inline bool is_letter(uint32_t cp) { return category(cp) == kLetter; }
inline bool is_number(uint32_t cp) { return category(cp) == kNumber; }

}  // namespace focus::io::unicode
