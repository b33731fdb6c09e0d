// Shared tokenizer pieces: GPT-2's byte alphabet, "<0xNN>" byte tokens, default token types.
#include "io/tokenizer_bpe_common.h"

#include "io/unicode.h"

namespace focus::io::bpe {

ByteUnicode::ByteUnicode() {
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? (uint32_t)b : (uint32_t)(256 + n++);
    unicode::append_utf8(encode[b], cp);
    decode[cp] = (uint8_t)b;
  }
}

const ByteUnicode& byte_unicode() {
  static const ByteUnicode t;
  return t;
}

// "<0xNN>" -> NN, or -1.
int parse_byte_token(std::string_view s) {
  if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
  int v = 0;
  for (size_t i = 3; i < 5; ++i) {
    const char c = s[i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= c - '0';
    else if (c >= 'A' && c <= 'F') v |= c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') v |= c - 'a' + 10;
    else return -1;
  }
  return v;
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  out.reserve(s.size());
  size_t pos = 0, hit;
  while ((hit = s.find(from, pos)) != std::string::npos) {
    out.append(s, pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

// Token types with defaults filled in when the source gave none.
std::vector<int32_t> effective_types(const VocabData& v) {
  const size_t n = v.tokens.size();
  if (!v.types.empty()) return v.types;
  std::vector<int32_t> t(n, kTypeNormal);
  for (size_t i = 0; i < n; ++i)
    if (v.kind == VocabData::Kind::SentencePiece && parse_byte_token(v.tokens[i]) >= 0) t[i] = kTypeByte;
  if (v.unk >= 0 && (size_t)v.unk < n) t[v.unk] = kTypeUnknown;
  for (int32_t s : {v.bos, v.eos})
    if (s >= 0 && (size_t)s < n) t[s] = kTypeControl;
  return t;
}

}  // namespace focus::io::bpe
