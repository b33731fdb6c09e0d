#include "io/unicode.h"

#include <algorithm>
#include <array>

namespace focus::io::unicode {
namespace {

struct CategoryRange {
  uint32_t first, last;
  Category cat;
};
struct CodeRange {
  uint32_t first, last;
};

#include "io/unicode_tables.inc"

// ASCII is by far the most common input: answer it from a small table.
const std::array<Category, 128> kAsciiCategory = [] {
  std::array<Category, 128> t{};
  for (uint32_t c = 0; c < 128; ++c) {
    const auto* it = std::upper_bound(std::begin(kCategoryRanges), std::end(kCategoryRanges), c,
                                      [](uint32_t v, const CategoryRange& r) { return v < r.first; });
    t[c] = (it != std::begin(kCategoryRanges) && c <= (it - 1)->last) ? (it - 1)->cat : kOther;
  }
  return t;
}();

}  // namespace

uint32_t decode_utf8(std::string_view s, size_t pos, size_t& len) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + pos;
  const size_t avail = s.size() - pos;
  len = 1;
  const unsigned char c = p[0];
  if (c < 0x80) return c;
  size_t n;
  uint32_t cp, min;
  if ((c & 0xE0) == 0xC0) {
    n = 2, cp = c & 0x1F, min = 0x80;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3, cp = c & 0x0F, min = 0x800;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4, cp = c & 0x07, min = 0x10000;
  } else {
    return kInvalid;
  }
  if (avail < n) return kInvalid;
  for (size_t i = 1; i < n; ++i) {
    if ((p[i] & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  len = n;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += (char)cp;
  } else if (cp < 0x800) {
    out += (char)(0xC0 | (cp >> 6));
    out += (char)(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += (char)(0xE0 | (cp >> 12));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  } else {
    out += (char)(0xF0 | (cp >> 18));
    out += (char)(0x80 | ((cp >> 12) & 0x3F));
    out += (char)(0x80 | ((cp >> 6) & 0x3F));
    out += (char)(0x80 | (cp & 0x3F));
  }
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if ((unsigned char)s[i] < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    if (decode_utf8(s, i, len) == kInvalid) return false;
    i += len;
  }
  return true;
}

Category category(uint32_t cp) {
  if (cp < 128) return kAsciiCategory[cp];
  if (cp == kInvalid) return kOther;
  const auto* it = std::upper_bound(std::begin(kCategoryRanges), std::end(kCategoryRanges), cp,
                                    [](uint32_t v, const CategoryRange& r) { return v < r.first; });
  if (it == std::begin(kCategoryRanges)) return kOther;
  --it;
  return cp <= it->last ? it->cat : kOther;
}

bool is_whitespace(uint32_t cp) {
  if (cp < 128) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  for (const auto& r : kWhiteSpaceRanges)
    if (cp >= r.first && cp <= r.last) return true;
  return false;
}

}  // namespace focus::io::unicode
