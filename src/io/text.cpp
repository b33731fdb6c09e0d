#include "io/text.h"

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/tokenizer.h"

namespace focus::io {
namespace {

// Position just after the line containing `marker` that starts with "***", or npos.
size_t find_marker_line(const std::string& s, const char* marker, bool after) {
  size_t pos = 0;
  while ((pos = s.find(marker, pos)) != std::string::npos) {
    const size_t ls = s.rfind('\n', pos) == std::string::npos ? 0 : s.rfind('\n', pos) + 1;
    if (s.compare(ls, 3, "***") == 0) {
      if (!after) return ls;
      const size_t nl = s.find('\n', pos);
      return nl == std::string::npos ? s.size() : nl + 1;
    }
    pos += 1;
  }
  return std::string::npos;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    int len;
    unsigned cp;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (int k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return i;
    i += len;
  }
  return std::string::npos;
}

std::string prepare_text(std::string_view raw, PrepareStats* stats) {
  PrepareStats st;
  st.bytes_in = raw.size();
  if (raw.size() >= 3 && raw.substr(0, 3) == "\xEF\xBB\xBF") {
    raw.remove_prefix(3);
    st.had_bom = true;
  }
  std::string s;
  s.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\r') {
      st.had_crlf = true;
      s.push_back('\n');
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    } else {
      s.push_back(raw[i]);
    }
  }
  const size_t start = find_marker_line(s, "START OF TH", true);
  if (start != std::string::npos) {
    size_t end = find_marker_line(s, "END OF TH", false);
    if (end == std::string::npos || end < start) end = s.size();
    // Some books carry the end-of-book line "End of the Project Gutenberg EBook" before the marker.
    const size_t alt = s.rfind("End of the Project Gutenberg", end);
    if (alt != std::string::npos && alt > start) end = s.rfind('\n', alt) == std::string::npos ? alt : s.rfind('\n', alt) + 1;
    s = s.substr(start, end - start);
    st.gutenberg = true;
    // Trim blank lines around the body.
    size_t a = s.find_first_not_of('\n');
    size_t b = s.find_last_not_of(" \n");
    s = a == std::string::npos ? std::string() : s.substr(a, b - a + 1) + "\n";
  }
  st.bytes_out = s.size();
  if (stats) *stats = st;
  return s;
}

std::string load_text(const std::string& path, PrepareStats* stats) {
  std::string raw = read_file(path);
  FOCUS_CHECK(!raw.empty(), path, ": the text file is empty");
  const size_t bad = find_invalid_utf8(raw);
  FOCUS_CHECK(bad == std::string::npos, path, ": invalid UTF-8 at byte offset ", bad);
  std::string s = prepare_text(raw, stats);
  FOCUS_CHECK(s.find_first_not_of(" \t\n") != std::string::npos, path, ": no text left after preparation");
  return s;
}

std::vector<int32_t> load_text_tokens(const Tokenizer& tok, const std::vector<std::string>& paths,
                                      int64_t max_tokens) {
  std::vector<int32_t> ids;
  for (const auto& path : paths) {
    const std::vector<int32_t> t = tok.encode(load_text(path), false);
    FOCUS_CHECK(!t.empty(), path, ": the text encodes to no tokens");
    ids.insert(ids.end(), t.begin(), t.end());
  }
  if (max_tokens > 0 && (int64_t)ids.size() > max_tokens) ids.resize(max_tokens);
  return ids;
}

}  // namespace focus::io
