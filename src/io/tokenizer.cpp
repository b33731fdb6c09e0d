// Byte-level BPE (ranked merges over GPT-2's byte alphabet, after a hand-written regex
// pre-tokenizer) and SentencePiece-style BPE (score-ordered merges over UTF-8 characters with
// byte fallback). Both merge with a priority queue over a linked list of symbols.
#include "io/tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "core/mapped_file.h"
#include "io/gguf.h"
#include "io/unicode.h"

namespace focus::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// GGUF token types.
constexpr int32_t kTypeNormal = 1, kTypeUnknown = 2, kTypeControl = 3, kTypeUser = 4, kTypeUnused = 5,
                  kTypeByte = 6;

const char* const kSpaceMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// ------------------------------------------------------------------ GPT-2 byte <-> unicode

// GPT-2 maps every byte to a printable code point so that token text never holds raw
// control bytes or spaces: printable Latin-1 bytes map to themselves, the rest to 256+n.
struct ByteUnicode {
  std::array<std::string, 256> encode;       // byte -> UTF-8 of its code point
  std::unordered_map<uint32_t, uint8_t> decode;  // code point -> byte
  ByteUnicode() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const uint32_t cp = printable ? (uint32_t)b : (uint32_t)(256 + n++);
      unicode::append_utf8(encode[b], cp);
      decode[cp] = (uint8_t)b;
    }
  }
};
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

// ------------------------------------------------------------------ pre-tokenizers

enum class Pre { Gpt2, SmolLM, Llama3, Qwen2 };

Pre pre_from_name(const std::string& name) {
  static const std::set<std::string> gpt2 = {"gpt2", "gpt-2", "default", "mpt", "olmo", "jais", "trillion"};
  static const std::set<std::string> smollm = {"smollm", "starcoder", "refact", "command-r", "codeshell",
                                               "exaone", "minerva-7b"};
  static const std::set<std::string> llama3 = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"};
  static const std::set<std::string> qwen2 = {"qwen2", "stablelm2", "deepseek-r1-qwen"};
  if (gpt2.count(name)) return Pre::Gpt2;
  if (smollm.count(name)) return Pre::SmolLM;
  if (llama3.count(name)) return Pre::Llama3;
  if (qwen2.count(name)) return Pre::Qwen2;
  static std::mutex mu;
  static std::set<std::string> warned;
  std::lock_guard<std::mutex> lock(mu);
  if (warned.insert(name).second)
    std::fprintf(stderr, "warning: unknown pre-tokenizer '%s'; using the GPT-2 pattern\n", name.c_str());
  return Pre::Gpt2;
}

// Character classes the patterns use.
enum : uint8_t { kL = 1, kN = 2, kW = 3, kO = 4 };  // \p{L}, \p{N}, \s, anything else

struct Char {
  uint32_t off;  // byte offset in the text
  uint32_t cp;   // code point (unicode::kInvalid for a stray byte)
  uint8_t cls;
};

void classify(std::string_view text, std::vector<Char>& out) {
  out.clear();
  for (size_t i = 0; i < text.size();) {
    size_t len = 1;
    const unsigned char b = (unsigned char)text[i];
    const uint32_t cp = b < 0x80 ? b : unicode::decode_utf8(text, i, len);
    uint8_t cls;
    if (unicode::is_whitespace(cp)) cls = kW;
    else {
      const auto c = unicode::category(cp);
      cls = c == unicode::kLetter ? kL : c == unicode::kNumber ? kN : kO;
    }
    out.push_back({(uint32_t)i, cp, cls});
    i += len;
  }
  out.push_back({(uint32_t)text.size(), 0, 0});  // sentinel: end offset
}

inline uint32_t lower_ascii(uint32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

// Length (in characters) of a contraction 's|'t|'re|'ve|'m|'ll|'d at i, or 0.
size_t contraction(const std::vector<Char>& c, size_t i, size_t e, bool icase) {
  if (c[i].cp != '\'' || i + 1 >= e) return 0;
  auto at = [&](size_t k) { return k < e ? (icase ? lower_ascii(c[k].cp) : c[k].cp) : 0u; };
  const uint32_t a = at(i + 1), b = at(i + 2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

// \s+(?!\S)|\s+ at i (c[i] is whitespace): the run, less its last character when
// non-whitespace follows and the run is longer than one.
size_t whitespace_end(const std::vector<Char>& c, size_t i, size_t e) {
  size_t r = i;
  while (r < e && c[r].cls == kW) ++r;
  if (r < e && r - i > 1) return r - 1;
  return r;
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ over chars [b, e).
template <typename Emit>
void split_gpt2(const std::vector<Char>& c, size_t b, size_t e, Emit&& emit) {
  size_t i = b;
  while (i < e) {
    size_t j = i;
    if (const size_t n = contraction(c, i, e, false)) {
      j = i + n;
    } else {
      const size_t k = (c[i].cp == ' ' && i + 1 < e) ? i + 1 : i;  // optional leading space
      const uint8_t t = c[k].cls;
      if (t == kL || t == kN || t == kO) {
        j = k + 1;
        while (j < e && c[j].cls == t) ++j;
      } else {
        j = whitespace_end(c, i, e);
      }
    }
    emit(i, j);
    i = j;
  }
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
template <typename Emit>
void split_llama3(const std::vector<Char>& c, size_t b, size_t e, size_t max_digits, Emit&& emit) {
  auto is_nl = [&](size_t k) { return c[k].cp == '\r' || c[k].cp == '\n'; };
  size_t i = b;
  while (i < e) {
    size_t j = i;
    const uint8_t t = c[i].cls;
    if (const size_t n = contraction(c, i, e, true)) {
      j = i + n;
    } else if (t == kL || (t != kN && !is_nl(i) && i + 1 < e && c[i + 1].cls == kL)) {
      j = i + 1;
      while (j < e && c[j].cls == kL) ++j;
    } else if (t == kN) {
      j = i + 1;
      while (j < e && j - i < max_digits && c[j].cls == kN) ++j;
    } else if (t == kO || (c[i].cp == ' ' && i + 1 < e && c[i + 1].cls == kO)) {
      j = (t == kO ? i : i + 1) + 1;
      while (j < e && c[j].cls == kO) ++j;
      while (j < e && is_nl(j)) ++j;
    } else {
      // Whitespace: up to the last newline of the run if it has one, else as GPT-2.
      size_t r = i, last_nl = e;
      while (r < e && c[r].cls == kW) {
        if (is_nl(r)) last_nl = r;
        ++r;
      }
      j = last_nl != e ? last_nl + 1 : whitespace_end(c, i, e);
    }
    emit(i, j);
    i = j;
  }
}

// Splits text into pre-tokens; calls emit(byte_begin, byte_end) for each, in order.
template <typename Emit>
void pre_tokenize(Pre pre, std::string_view text, std::vector<Char>& chars, Emit&& emit) {
  classify(text, chars);
  const size_t n = chars.size() - 1;
  auto emit_chars = [&](size_t i, size_t j) { emit(chars[i].off, chars[j].off); };
  switch (pre) {
    case Pre::Gpt2:
      split_gpt2(chars, 0, n, emit_chars);
      break;
    case Pre::SmolLM: {  // every \p{N} alone, then GPT-2 on the pieces between
      size_t start = 0;
      for (size_t i = 0; i <= n; ++i) {
        if (i < n && chars[i].cls != kN) continue;
        if (i > start) split_gpt2(chars, start, i, emit_chars);
        if (i < n) emit_chars(i, i + 1);
        start = i + 1;
      }
      break;
    }
    case Pre::Llama3:
      split_llama3(chars, 0, n, 3, emit_chars);
      break;
    case Pre::Qwen2:
      split_llama3(chars, 0, n, 1, emit_chars);
      break;
  }
}

// ------------------------------------------------------------------ shared pieces

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

// User-defined tokens (type 4) are cut out of the text whole before BPE runs, as
// SentencePiece and Hugging Face tokenizers do; leftmost, then longest match wins.
class UserTokens {
 public:
  void add(std::string text, int32_t id) {
    if (text.empty()) return;
    const unsigned char first = (unsigned char)text[0];
    by_first_[first].push_back({std::move(text), id});
    any_ = true;
  }
  void finish() {  // longest first within each bucket
    for (auto& b : by_first_)
      std::stable_sort(b.begin(), b.end(), [](const Entry& x, const Entry& y) { return x.text.size() > y.text.size(); });
  }
  bool empty() const { return !any_; }
  // Calls raw(string_view) for text between matches and tok(id) for each match.
  template <typename Raw, typename Tok>
  void partition(std::string_view text, Raw&& raw, Tok&& tok) const {
    if (!any_) {
      if (!text.empty()) raw(text, (size_t)0);
      return;
    }
    size_t start = 0;
    for (size_t p = 0; p < text.size();) {
      int32_t id = -1;
      size_t len = 0;
      for (const Entry& e : by_first_[(unsigned char)text[p]])
        if (e.text.size() <= text.size() - p && text.compare(p, e.text.size(), e.text) == 0) {
          id = e.id, len = e.text.size();
          break;
        }
      if (id < 0) {
        ++p;
        continue;
      }
      if (p > start) raw(text.substr(start, p - start), start);
      tok(id);
      p += len;
      start = p;
    }
    if (start < text.size()) raw(text.substr(start), start);
  }

 private:
  struct Entry {
    std::string text;
    int32_t id;
  };
  std::array<std::vector<Entry>, 256> by_first_;
  bool any_ = false;
};

// Symbols of one word in a doubly linked list, merged by priority: lowest cost first,
// leftmost on ties. find(left, right) gives {cost, merged id} or cost = NaN for "no merge".
struct Symbol {
  int32_t prev, next;
  uint32_t start, len;  // bytes in the word
  int32_t id;           // token id, or -1 while unknown
};

struct MergeCandidate {
  double cost;
  int32_t left, right;
  uint32_t len;  // combined length when queued (stale entries no longer match)
  int32_t id;
  // Heap order: the top is the lowest cost, then the leftmost.
  bool operator<(const MergeCandidate& o) const {
    if (cost != o.cost) return cost > o.cost;
    return left > o.left;
  }
};

// `heap` is scratch space, passed in so that its allocation is reused across words.
template <typename Find>
void merge_symbols(std::vector<Symbol>& sym, std::vector<MergeCandidate>& heap, Find&& find) {
  heap.clear();
  auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const auto [cost, id] = find(sym[l], sym[r]);
    if (std::isnan(cost)) return;
    heap.push_back({cost, l, r, sym[l].len + sym[r].len, id});
    std::push_heap(heap.begin(), heap.end());
  };
  for (int32_t i = 0; i + 1 < (int32_t)sym.size(); ++i) consider(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const MergeCandidate m = heap.back();
    heap.pop_back();
    Symbol& l = sym[m.left];
    Symbol& r = sym[m.right];
    if (l.len == 0 || r.len == 0 || l.next != m.right || l.len + r.len != m.len) continue;
    l.len += r.len;
    l.id = m.id;
    l.next = r.next;
    if (r.next >= 0) sym[r.next].prev = m.left;
    r.len = 0;
    consider(l.prev, m.left);
    consider(m.left, l.next);
  }
}

struct PairHash {
  size_t operator()(uint64_t k) const { return std::hash<uint64_t>()(k * 0x9E3779B97F4A7C15ull); }
};

// ------------------------------------------------------------------ byte-level BPE

class ByteBPETokenizer final : public Tokenizer {
 public:
  explicit ByteBPETokenizer(const VocabData& v, const std::string& source)
      : pre_(pre_from_name(v.pre)), bos_(v.bos), eos_(v.eos), unk_(v.unk), add_bos_(v.add_bos) {
    const size_t n = v.tokens.size();
    const auto types = effective_types(v);
    const auto& bu = byte_unicode();
    std::unordered_map<std::string_view, int32_t> id_of;
    id_of.reserve(n * 2);
    decoded_.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const std::string& t = v.tokens[i];
      FOCUS_CHECK(unicode::is_valid_utf8(t), source, ": token ", i, " is not valid UTF-8");
      id_of.emplace(t, (int32_t)i);
      if (types[i] == kTypeControl || types[i] == kTypeUser || types[i] == kTypeUnknown) {
        decoded_[i] = ((int32_t)i == bos_ || (int32_t)i == eos_) ? std::string() : t;
        if (types[i] == kTypeUser) user_.add(t, (int32_t)i);
        continue;
      }
      std::string& d = decoded_[i];
      for (size_t p = 0; p < t.size();) {
        size_t len;
        const uint32_t cp = unicode::decode_utf8(t, p, len);
        auto it = bu.decode.find(cp);
        if (it != bu.decode.end()) d += (char)it->second;
        else d.append(t, p, len);  // not a byte-level character: keep as is
        p += len;
      }
    }
    user_.finish();
    for (int b = 0; b < 256; ++b) {
      auto it = id_of.find(bu.encode[b]);
      byte_tok_[b] = (it != id_of.end() && types[it->second] == kTypeNormal) ? it->second : -1;
    }
    merges_.reserve(v.merges.size() * 2);
    for (size_t r = 0; r < v.merges.size(); ++r) {
      const std::string& m = v.merges[r];
      const size_t sp = m.find(' ', 1);
      FOCUS_CHECK(sp != std::string::npos, source, ": merge ", r, " ('", m, "') is not two tokens separated by a space");
      const std::string_view a(m.data(), sp), b(m.data() + sp + 1, m.size() - sp - 1);
      auto ia = id_of.find(a), ib = id_of.find(b);
      FOCUS_CHECK(ia != id_of.end(), source, ": merge ", r, " ('", m, "') references unknown token '", a, "'");
      FOCUS_CHECK(ib != id_of.end(), source, ": merge ", r, " ('", m, "') references unknown token '", b, "'");
      const std::string ab = std::string(a) + std::string(b);
      auto iab = id_of.find(ab);
      FOCUS_CHECK(iab != id_of.end(), source, ": merge ", r, " ('", m, "') makes '", ab, "', which is not in the vocabulary");
      if (types[iab->second] == kTypeControl) continue;  // never produce control tokens from text
      merges_.emplace(key(ia->second, ib->second), std::make_pair((int32_t)r, iab->second));
    }
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_bos && bos_ >= 0) out.push_back(bos_);
    std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;  // word -> span in `cached`
    std::vector<int32_t> cached;
    std::vector<Char> chars;
    std::vector<Symbol> sym;
    std::vector<MergeCandidate> heap;
    auto encode_word = [&](std::string_view w) {
      if (w.size() <= 64) {
        auto it = cache.find(w);
        if (it != cache.end()) {
          out.insert(out.end(), cached.begin() + it->second.first, cached.begin() + it->second.second);
          return;
        }
      }
      const size_t first = out.size();
      bpe_word(w, sym, heap, out);
      if (w.size() <= 64) {
        const uint32_t s = (uint32_t)cached.size();
        cached.insert(cached.end(), out.begin() + first, out.end());
        cache.emplace(w, std::make_pair(s, (uint32_t)cached.size()));
      }
    };
    user_.partition(
        text,
        [&](std::string_view raw, size_t) {
          pre_tokenize(pre_, raw, chars, [&](uint32_t b, uint32_t e) { encode_word(raw.substr(b, e - b)); });
        },
        [&](int32_t id) { out.push_back(id); });
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (int32_t id : ids) s += piece(id, -1);
    return s;
  }
  std::string piece(int32_t id, int32_t) const override {
    FOCUS_CHECK(id >= 0 && (size_t)id < decoded_.size(), "decode: token id ", id, " out of range [0, ",
                decoded_.size(), ")");
    return decoded_[id];
  }
  int32_t vocab_size() const override { return (int32_t)decoded_.size(); }
  int32_t bos() const override { return bos_; }
  int32_t eos() const override { return eos_; }
  bool add_bos_default() const override { return add_bos_; }

 private:
  static uint64_t key(int32_t a, int32_t b) { return ((uint64_t)(uint32_t)a << 32) | (uint32_t)b; }

  void bpe_word(std::string_view w, std::vector<Symbol>& sym, std::vector<MergeCandidate>& heap,
                std::vector<int32_t>& out) const {
    sym.clear();
    for (size_t i = 0; i < w.size(); ++i) {
      int32_t id = byte_tok_[(unsigned char)w[i]];
      if (id < 0) {
        FOCUS_CHECK(unk_ >= 0, "tokenizer: byte 0x", std::hex, (int)(unsigned char)w[i],
                    " has no token in the vocabulary and there is no unknown token");
        id = unk_;
      }
      sym.push_back({(int32_t)i - 1, i + 1 < w.size() ? (int32_t)i + 1 : -1, (uint32_t)i, 1, id});
    }
    if (sym.size() > 1)
      merge_symbols(sym, heap, [&](const Symbol& l, const Symbol& r) -> std::pair<double, int32_t> {
        auto it = merges_.find(key(l.id, r.id));
        if (it == merges_.end()) return {std::nan(""), -1};
        return {(double)it->second.first, it->second.second};
      });
    for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
  }

  Pre pre_;
  int32_t bos_, eos_, unk_;
  bool add_bos_;
  std::vector<std::string> decoded_;
  std::array<int32_t, 256> byte_tok_{};
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>, PairHash> merges_;  // (a, b) -> (rank, a+b)
  UserTokens user_;
};

// ------------------------------------------------------------------ SentencePiece-style BPE

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer(const VocabData& v, const std::string& source)
      : tokens_(v.tokens), scores_(v.scores), bos_(v.bos), eos_(v.eos), unk_(v.unk), add_bos_(v.add_bos),
        add_space_prefix_(v.add_space_prefix) {
    const size_t n = tokens_.size();
    types_ = effective_types(v);
    // GGUF/SentencePiece vocabularies write spaces as U+2581; llama2.c exports use plain spaces.
    size_t with_marker = 0, with_space = 0;
    for (size_t i = 0; i < n; ++i) {
      if (types_[i] != kTypeNormal) continue;
      with_marker += tokens_[i].find(kSpaceMarker) != std::string::npos;
      with_space += tokens_[i].find(' ') != std::string::npos;
    }
    escape_ = with_marker > with_space;
    byte_tok_.fill(-1);
    decoded_.resize(n);
    normal_.reserve(n * 2);
    for (size_t i = 0; i < n; ++i) {
      const std::string& t = tokens_[i];
      const int32_t type = types_[i];
      const int32_t id = (int32_t)i;
      if (type == kTypeByte) {
        const int b = parse_byte_token(t);
        FOCUS_CHECK(b >= 0, source, ": byte token ", i, " is '", t, "', expected <0xNN>");
        if (byte_tok_[b] < 0) byte_tok_[b] = id;
        decoded_[i] = std::string(1, (char)b);
        continue;
      }
      if (type == kTypeControl || type == kTypeUnknown || type == kTypeUnused) {
        decoded_[i] = (id == bos_ || id == eos_) ? std::string() : t;
        continue;
      }
      decoded_[i] = t;
      if (escape_) replace_all(decoded_[i], kSpaceMarker, " ");
      if (type == kTypeUser) {  // matched in the raw text, so with plain spaces
        user_.add(decoded_[i], id);
        continue;
      }
      if (normal_.emplace(t, id).second) max_len_ = std::max(max_len_, t.size());
    }
    user_.finish();
    // Characters that some piece has right before a space: elsewhere no piece spans the
    // point before a space, so the text can be cut there without changing the result.
    const std::string_view marker = escape_ ? std::string_view(kSpaceMarker) : std::string_view(" ");
    for (const auto& [t, id] : normal_) {
      for (size_t p = t.find(marker, 1); p != std::string::npos; p = t.find(marker, p + 1)) {
        size_t q = p - 1;
        while (q > 0 && ((unsigned char)t[q] & 0xC0) == 0x80) --q;
        size_t len;
        before_space_.insert(unicode::decode_utf8(t, q, len));
      }
    }
    space_cp_ = escape_ ? 0x2581 : ' ';
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos) const override {
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_bos && bos_ >= 0) out.push_back(bos_);
    Work work;
    std::deque<std::string> bufs;  // cached chunks point into these
    user_.partition(
        text,
        [&](std::string_view raw, size_t offset) {
          std::string& buf = bufs.emplace_back();
          if (add_space_prefix_ && offset == 0) buf += ' ';
          buf.append(raw);
          if (escape_) replace_all(buf, " ", kSpaceMarker);
          encode_fragment(buf, work, out);
        },
        [&](int32_t id) { out.push_back(id); });
    return out;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    bool first = true;
    for (int32_t id : ids) {
      check_id(id);
      const std::string& d = decoded_[id];
      if (first && !d.empty()) {
        first = false;
        if (strip_prefix(id)) {
          s.append(d, 1);
          continue;
        }
      }
      s += d;
    }
    return s;
  }
  std::string piece(int32_t id, int32_t prev) const override {
    check_id(id);
    if ((prev < 0 || prev == bos_) && strip_prefix(id)) return decoded_[id].substr(1);
    return decoded_[id];
  }
  int32_t vocab_size() const override { return (int32_t)tokens_.size(); }
  int32_t bos() const override { return bos_; }
  int32_t eos() const override { return eos_; }
  bool add_bos_default() const override { return add_bos_; }

 private:
  void check_id(int32_t id) const {
    FOCUS_CHECK(id >= 0 && (size_t)id < decoded_.size(), "decode: token id ", id, " out of range [0, ",
                decoded_.size(), ")");
  }
  // The dummy prefix is the first piece's leading space; only normal pieces carry it.
  bool strip_prefix(int32_t id) const {
    return add_space_prefix_ && types_[id] == kTypeNormal && !decoded_[id].empty() && decoded_[id][0] == ' ';
  }

  // Cuts a fragment where no piece can span (before a space whose left neighbour never
  // precedes a space inside a piece) and encodes the chunks, reusing results for repeats.
  struct Work {
    std::vector<Symbol> sym;
    std::vector<MergeCandidate> heap;
    std::unordered_map<std::string_view, std::pair<uint32_t, uint32_t>> cache;  // chunk -> span in `cached`
    std::vector<int32_t> cached;
  };

  void encode_fragment(std::string_view s, Work& w, std::vector<int32_t>& out) const {
    size_t start = 0;
    uint32_t prev = unicode::kInvalid;
    for (size_t i = 0; i < s.size();) {
      size_t len = 1;
      const uint32_t cp = (unsigned char)s[i] < 0x80 ? (unsigned char)s[i] : unicode::decode_utf8(s, i, len);
      if (cp == space_cp_ && i > start && !before_space_.count(prev)) {
        encode_chunk(s.substr(start, i - start), w, out);
        start = i;
      }
      prev = cp;
      i += len;
    }
    if (start < s.size()) encode_chunk(s.substr(start), w, out);
  }

  void encode_chunk(std::string_view s, Work& w, std::vector<int32_t>& out) const {
    const bool cacheable = s.size() <= 64;
    if (cacheable) {
      auto it = w.cache.find(s);
      if (it != w.cache.end()) {
        out.insert(out.end(), w.cached.begin() + it->second.first, w.cached.begin() + it->second.second);
        return;
      }
    }
    const size_t first = out.size();
    bpe_chunk(s, w.sym, w.heap, out);
    if (cacheable) {
      const uint32_t b = (uint32_t)w.cached.size();
      w.cached.insert(w.cached.end(), out.begin() + first, out.end());
      w.cache.emplace(s, std::make_pair(b, (uint32_t)w.cached.size()));
    }
  }

  void bpe_chunk(std::string_view s, std::vector<Symbol>& sym, std::vector<MergeCandidate>& heap,
                 std::vector<int32_t>& out) const {
    sym.clear();
    for (size_t i = 0; i < s.size();) {
      const size_t len = unicode::utf8_len(s, i);
      auto it = normal_.find(s.substr(i, len));
      sym.push_back({(int32_t)sym.size() - 1, -1, (uint32_t)i, (uint32_t)len, it != normal_.end() ? it->second : -1});
      i += len;
    }
    if (sym.empty()) return;
    for (size_t i = 0; i + 1 < sym.size(); ++i) sym[i].next = (int32_t)i + 1;
    merge_symbols(sym, heap, [&](const Symbol& l, const Symbol& r) -> std::pair<double, int32_t> {
      const size_t len = l.len + r.len;
      if (len > max_len_) return {std::nan(""), -1};
      auto it = normal_.find(s.substr(l.start, len));
      if (it == normal_.end()) return {std::nan(""), -1};
      return {-(double)scores_[it->second], it->second};
    });
    for (int32_t i = 0; i >= 0; i = sym[i].next) {
      const Symbol& y = sym[i];
      if (y.id >= 0) {
        out.push_back(y.id);
        continue;
      }
      for (uint32_t k = 0; k < y.len; ++k) {  // byte fallback
        const int32_t b = byte_tok_[(unsigned char)s[y.start + k]];
        if (b >= 0) {
          out.push_back(b);
        } else {
          FOCUS_CHECK(unk_ >= 0, "tokenizer: '", s.substr(y.start, y.len),
                      "' is not in the vocabulary, which has no byte tokens and no unknown token");
          out.push_back(unk_);
          break;
        }
      }
    }
  }

  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::vector<int32_t> types_;
  int32_t bos_, eos_, unk_;
  bool add_bos_, add_space_prefix_;
  bool escape_ = false;
  std::vector<std::string> decoded_;
  std::array<int32_t, 256> byte_tok_{};
  std::unordered_map<std::string_view, int32_t> normal_;  // views into tokens_
  size_t max_len_ = 0;
  std::unordered_set<uint32_t> before_space_;
  uint32_t space_cp_ = ' ';
  UserTokens user_;
};

// ------------------------------------------------------------------ validation and loaders

void check_vocab(const VocabData& v, const std::string& source) {
  const size_t n = v.tokens.size();
  FOCUS_CHECK(n > 0, source, ": the vocabulary is empty");
  FOCUS_CHECK(n < (size_t)INT32_MAX, source, ": vocabulary too large (", n, " tokens)");
  FOCUS_CHECK(v.types.empty() || v.types.size() == n, source, ": ", v.types.size(), " token types for ", n, " tokens");
  if (v.kind == VocabData::Kind::SentencePiece) {
    FOCUS_CHECK(v.scores.size() == n, source, ": ", v.scores.size(), " scores for ", n, " tokens");
    for (size_t i = 0; i < n; ++i)
      FOCUS_CHECK(std::isfinite(v.scores[i]), source, ": token ", i, " has a non-finite score");
  }
  for (auto [name, id] : {std::pair<const char*, int32_t>{"BOS", v.bos}, {"EOS", v.eos}, {"unknown", v.unk}})
    FOCUS_CHECK(id >= -1 && id < (int64_t)n, source, ": ", name, " token id ", id, " is outside the vocabulary (",
                n, " tokens)");
}

std::unique_ptr<Tokenizer> build(const VocabData& v, const std::string& source) {
  check_vocab(v, source);
  if (v.kind == VocabData::Kind::ByteBPE) return std::make_unique<ByteBPETokenizer>(v, source);
  return std::make_unique<SentencePieceTokenizer>(v, source);
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

json parse_json_file(const std::string& path) {
  const std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    fail(path, ": invalid JSON: ", e.what());
  }
}

// Token -> id object to a dense token list.
std::vector<std::string> tokens_from_map(const json& m, const std::string& path) {
  FOCUS_CHECK(m.is_object(), path, ": expected a JSON object mapping token -> id");
  std::vector<std::string> tokens(m.size());
  std::vector<bool> seen(m.size(), false);
  for (auto it = m.begin(); it != m.end(); ++it) {
    FOCUS_CHECK(it.value().is_number_integer(), path, ": the id of token '", it.key(), "' is not an integer");
    const int64_t id = it.value().get<int64_t>();
    FOCUS_CHECK(id >= 0 && id < (int64_t)tokens.size(), path, ": token '", it.key(), "' has id ", id,
                ", outside 0..", tokens.size() - 1, " (ids must be dense)");
    FOCUS_CHECK(!seen[id], path, ": id ", id, " is given to more than one token");
    seen[id] = true;
    tokens[id] = it.key();
  }
  return tokens;
}

void check_merges(const std::vector<std::string>& tokens, const std::vector<std::string>& merges,
                  const std::string& path) {
  std::unordered_set<std::string_view> have(tokens.begin(), tokens.end());
  for (size_t r = 0; r < merges.size(); ++r) {
    const std::string& m = merges[r];
    const size_t sp = m.find(' ', 1);
    FOCUS_CHECK(sp != std::string::npos, path, ": merge ", r + 1, " ('", m, "') is not two tokens separated by a space");
    const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
    FOCUS_CHECK(have.count(a), path, ": merge ", r + 1, " ('", m, "') references unknown token '", a, "'");
    FOCUS_CHECK(have.count(b), path, ": merge ", r + 1, " ('", m, "') references unknown token '", b, "'");
    FOCUS_CHECK(have.count(a + b), path, ": merge ", r + 1, " ('", m, "') makes '", a + b,
                "', which is not in the vocabulary");
  }
}

int32_t find_token(const std::vector<std::string>& tokens, std::initializer_list<const char*> names) {
  for (const char* name : names)
    for (size_t i = 0; i < tokens.size(); ++i)
      if (tokens[i] == name) return (int32_t)i;
  return -1;
}

// A Hugging Face tokenizer.json holding a BPE model.
VocabData vocab_from_hf_json(const std::string& path) {
  const json j = parse_json_file(path);
  FOCUS_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), path,
              ": not a Hugging Face tokenizer.json (no \"model\" object)");
  const json& model = j["model"];
  const std::string type = model.value("type", std::string("BPE"));
  FOCUS_CHECK(type == "BPE", path, ": tokenizer model type '", type, "' is not supported (only BPE)");
  FOCUS_CHECK(model.contains("vocab"), path, ": model has no vocab");
  VocabData v;
  v.tokens = tokens_from_map(model["vocab"], path);
  v.types.assign(v.tokens.size(), kTypeNormal);
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& a : j["added_tokens"]) {
      FOCUS_CHECK(a.is_object() && a.contains("id") && a.contains("content") && a["id"].is_number_integer() &&
                      a["content"].is_string(),
                  path, ": malformed entry in added_tokens");
      const int64_t id = a["id"].get<int64_t>();
      FOCUS_CHECK(id >= 0 && id < (int64_t)1 << 30, path, ": added token id ", id, " out of range");
      if ((size_t)id >= v.tokens.size()) {
        v.tokens.resize(id + 1);
        v.types.resize(id + 1, kTypeUnused);
      }
      v.tokens[id] = a["content"].get<std::string>();
      v.types[id] = a.value("special", false) ? kTypeControl : kTypeUser;
    }
  }
  if (model.contains("merges")) {
    FOCUS_CHECK(model["merges"].is_array(), path, ": model.merges is not an array");
    for (const json& m : model["merges"]) {
      if (m.is_string()) {
        v.merges.push_back(m.get<std::string>());
      } else {
        FOCUS_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(), path,
                    ": malformed merge entry ", m.dump());
        v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
      }
    }
  }
  const std::string dump_pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"].dump() : "";
  const std::string dump_dec = j.contains("decoder") ? j["decoder"].dump() : "";
  const std::string dump_norm = j.contains("normalizer") ? j["normalizer"].dump() : "";
  const bool byte_level = dump_pre.find("\"ByteLevel\"") != std::string::npos ||
                          dump_dec.find("\"ByteLevel\"") != std::string::npos;
  if (byte_level) {
    v.kind = VocabData::Kind::ByteBPE;
    check_merges(v.tokens, v.merges, path);
    const json& pre = j.contains("pre_tokenizer") ? j["pre_tokenizer"] : json();
    v.pre = "gpt2";
    if (dump_pre.find("\"Digits\"") != std::string::npos && dump_pre.find("\"individual_digits\":true") != std::string::npos)
      v.pre = "smollm";
    if (pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers")) {
      for (const json& p : pre["pretokenizers"]) {
        if (p.value("type", "") != "Split" || !p.contains("pattern") || !p["pattern"].contains("Regex")) continue;
        const std::string re = p["pattern"]["Regex"].get<std::string>();
        const std::string llama3 =
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
            "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        const std::string qwen2 =
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
            "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
        if (re == llama3) v.pre = "llama3";
        else if (re == qwen2) v.pre = "qwen2";
        else v.pre = "unrecognised Split pattern " + re;
      }
    }
  } else {
    // SentencePiece-style BPE written as ranked merges (Llama/Gemma tokenizer.json): a token's
    // score is minus the rank of the first merge making it; tokens no merge makes are left
    // out of merging.
    FOCUS_CHECK(model.value("byte_fallback", false) || dump_norm.find(kSpaceMarker) != std::string::npos ||
                    dump_pre.find("Metaspace") != std::string::npos,
                path, ": BPE model is neither byte-level nor SentencePiece-style (unsupported)");
    v.kind = VocabData::Kind::SentencePiece;
    check_merges(v.tokens, v.merges, path);
    std::unordered_map<std::string_view, int32_t> id_of;
    for (size_t i = 0; i < v.tokens.size(); ++i) id_of.emplace(v.tokens[i], (int32_t)i);
    v.scores.assign(v.tokens.size(), 0.f);
    std::vector<bool> made(v.tokens.size(), false);
    for (size_t r = 0; r < v.merges.size(); ++r) {
      std::string ab = v.merges[r];
      ab.erase(ab.find(' ', 1), 1);
      const int32_t id = id_of.at(ab);
      if (!made[id]) v.scores[id] = -(float)r, made[id] = true;
    }
    for (size_t i = 0; i < v.tokens.size(); ++i) {
      if (v.types[i] != kTypeNormal) continue;
      if (parse_byte_token(v.tokens[i]) >= 0) v.types[i] = kTypeByte;
      else if (!made[i] && unicode::utf8_len(v.tokens[i], 0) < v.tokens[i].size()) v.types[i] = kTypeUnused;
    }
    v.add_space_prefix = dump_norm.find("Prepend") != std::string::npos ||
                         (dump_pre.find("Metaspace") != std::string::npos &&
                          dump_pre.find("\"prepend_scheme\":\"never\"") == std::string::npos);
    v.merges.clear();
  }
  if (model.contains("unk_token") && model["unk_token"].is_string())
    v.unk = find_token(v.tokens, {model["unk_token"].get_ref<const std::string&>().c_str()});
  // BOS/EOS: tokenizer_config.json beside the file when present, else the usual names.
  const fs::path cfg = fs::path(path).parent_path() / "tokenizer_config.json";
  bool have_cfg = false;
  if (fs::exists(cfg)) {
    const json c = parse_json_file(cfg.string());
    auto tok_name = [](const json& t) -> std::string {
      if (t.is_string()) return t.get<std::string>();
      if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
      return "";
    };
    if (c.contains("bos_token")) v.bos = find_token(v.tokens, {tok_name(c["bos_token"]).c_str()});
    if (c.contains("eos_token")) v.eos = find_token(v.tokens, {tok_name(c["eos_token"]).c_str()});
    if (c.contains("add_bos_token") && c["add_bos_token"].is_boolean()) v.add_bos = c["add_bos_token"].get<bool>();
    have_cfg = true;
  }
  if (!have_cfg) {
    v.bos = find_token(v.tokens, {"<|begin_of_text|>", "<s>", "<bos>", "<|endoftext|>"});
    v.eos = find_token(v.tokens, {"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
    v.add_bos = v.kind == VocabData::Kind::SentencePiece || find_token(v.tokens, {"<|begin_of_text|>"}) >= 0;
  }
  return v;
}

}  // namespace

// ------------------------------------------------------------------ public API

std::unique_ptr<Tokenizer> make_tokenizer(const VocabData& v) { return build(v, "tokenizer"); }

VocabData vocab_from_gguf(const GGUFFile& f) {
  const std::string& path = f.path();
  VocabData v;
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model == "gpt2") v.kind = VocabData::Kind::ByteBPE;
  else if (model == "llama") v.kind = VocabData::Kind::SentencePiece;
  else fail(path, ": tokenizer model '", model, "' is not supported (expected 'gpt2' or 'llama')");
  v.tokens = f.get_string_array("tokenizer.ggml.tokens");
  const size_t n = v.tokens.size();
  if (f.has("tokenizer.ggml.scores")) {
    const auto s = f.get_float_array("tokenizer.ggml.scores");
    FOCUS_CHECK(s.size() == n, path, ": tokenizer.ggml.scores has ", s.size(), " entries for ", n, " tokens");
    v.scores.assign(s.begin(), s.end());
  } else {
    FOCUS_CHECK(v.kind != VocabData::Kind::SentencePiece, path, ": 'llama' tokenizer without tokenizer.ggml.scores");
  }
  if (f.has("tokenizer.ggml.token_type")) {
    const auto t = f.get_int_array("tokenizer.ggml.token_type");
    FOCUS_CHECK(t.size() == n, path, ": tokenizer.ggml.token_type has ", t.size(), " entries for ", n, " tokens");
    v.types.assign(t.begin(), t.end());
  }
  if (v.kind == VocabData::Kind::ByteBPE) {
    v.merges = f.get_string_array("tokenizer.ggml.merges");
    check_merges(v.tokens, v.merges, path);
    v.pre = f.get_string("tokenizer.ggml.pre", "gpt2");
  }
  v.bos = (int32_t)f.get_int("tokenizer.ggml.bos_token_id", -1);
  v.eos = (int32_t)f.get_int("tokenizer.ggml.eos_token_id", -1);
  v.unk = (int32_t)f.get_int("tokenizer.ggml.unknown_token_id", -1);
  const bool spm = v.kind == VocabData::Kind::SentencePiece;
  v.add_bos = f.get_int("tokenizer.ggml.add_bos_token", spm ? 1 : 0) != 0;
  v.add_space_prefix = f.get_int("tokenizer.ggml.add_space_prefix", spm ? 1 : 0) != 0;
  check_vocab(v, path);
  for (size_t i = 0; i < n; ++i)
    FOCUS_CHECK(unicode::is_valid_utf8(v.tokens[i]), path, ": token ", i, " is not valid UTF-8");
  return v;
}

VocabData vocab_from_llama2c(const std::string& path, int32_t vocab_size) {
  FOCUS_CHECK(vocab_size >= 0, path, ": negative vocabulary size ", vocab_size);
  MappedFile f(path);
  const uint8_t* p = f.data();
  const size_t size = f.size();
  FOCUS_CHECK(size >= 4, path, ": too small for a llama2.c tokenizer (", size, " bytes)");
  int32_t max_len;
  std::memcpy(&max_len, p, 4);
  FOCUS_CHECK(max_len > 0 && max_len <= (1 << 16), path, ": implausible max_token_length ", max_len,
              " (not a llama2.c tokenizer?)");
  VocabData v;
  v.kind = VocabData::Kind::SentencePiece;
  size_t pos = 4;
  while (vocab_size == 0 ? pos < size : v.tokens.size() < (size_t)vocab_size) {
    const size_t i = v.tokens.size();
    FOCUS_CHECK(size - pos >= 8, path, ": truncated at token ", i, " (offset ", pos, ", ", size - pos,
                " bytes left, need 8 for score and length)");
    float score;
    int32_t len;
    std::memcpy(&score, p + pos, 4);
    std::memcpy(&len, p + pos + 4, 4);
    pos += 8;
    FOCUS_CHECK(len >= 0 && (size_t)len <= size - pos, path, ": token ", i, " at offset ", pos - 4,
                " claims ", len, " bytes but only ", size - pos, " remain (truncated or corrupt)");
    FOCUS_CHECK(std::isfinite(score), path, ": token ", i, " has a non-finite score");
    v.tokens.emplace_back(reinterpret_cast<const char*>(p + pos), (size_t)len);
    v.scores.push_back(score);
    pos += len;
  }
  FOCUS_CHECK(v.tokens.size() >= 3, path, ": only ", v.tokens.size(), " tokens");
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  v.add_bos = true;
  v.add_space_prefix = true;
  return v;
}

VocabData vocab_from_gpt2_files(const std::string& vocab_json, const std::string& merges_txt) {
  VocabData v;
  v.kind = VocabData::Kind::ByteBPE;
  v.tokens = tokens_from_map(parse_json_file(vocab_json), vocab_json);
  const std::string text = read_file(merges_txt);
  size_t pos = 0, line_no = 0;
  while (pos < text.size()) {
    size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(pos, nl - pos);
    pos = nl + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    FOCUS_CHECK(line.find(' ', 1) != std::string::npos, merges_txt, ":", line_no, ": expected 'token token', got '",
                line, "'");
    v.merges.push_back(std::move(line));
  }
  {
    std::unordered_set<std::string_view> have(v.tokens.begin(), v.tokens.end());
    for (size_t r = 0; r < v.merges.size(); ++r) {
      const std::string& m = v.merges[r];
      const size_t sp = m.find(' ', 1);
      for (const std::string& t : {m.substr(0, sp), m.substr(sp + 1), m.substr(0, sp) + m.substr(sp + 1)})
        FOCUS_CHECK(have.count(t), merges_txt, ": merge ", r + 1, " ('", m, "') references token '", t, "', which is not in ",
                    vocab_json);
    }
  }
  v.pre = "gpt2";
  const int32_t eot = find_token(v.tokens, {"<|endoftext|>"});
  v.bos = v.eos = eot;
  if (eot >= 0) {
    v.types.assign(v.tokens.size(), kTypeNormal);
    v.types[eot] = kTypeControl;
  }
  return v;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path, int32_t vocab_size) {
  FOCUS_CHECK(fs::exists(path), path, ": no such file or directory");
  if (fs::is_directory(path)) {
    const fs::path d(path);
    for (auto [vj, mt] : {std::pair<const char*, const char*>{"vocab.json", "merges.txt"}, {"encoder.json", "vocab.bpe"}})
      if (fs::exists(d / vj) && fs::exists(d / mt))
        return build(vocab_from_gpt2_files((d / vj).string(), (d / mt).string()), path);
    if (fs::exists(d / "tokenizer.json")) return load_tokenizer((d / "tokenizer.json").string(), vocab_size);
    if (fs::exists(d / "tokenizer.bin")) return load_tokenizer((d / "tokenizer.bin").string(), vocab_size);
    fail(path, ": no tokenizer here (looked for vocab.json + merges.txt, encoder.json + vocab.bpe, tokenizer.json, "
               "tokenizer.bin)");
  }
  char magic[4] = {0, 0, 0, 0};
  {
    MappedFile f(path);
    if (f.size() >= 4) std::memcpy(magic, f.data(), 4);
  }
  if (std::memcmp(magic, "GGUF", 4) == 0) {
    GGUFFile f(path);
    return build(vocab_from_gguf(f), path);
  }
  const std::string name = fs::path(path).filename().string();
  FOCUS_CHECK(!ends_with(name, ".model"), path,
              ": SentencePiece .model files are not read directly; use its llama2.c tokenizer.bin export or a GGUF");
  if (ends_with(name, ".json")) {
    if (name == "vocab.json" || name == "encoder.json") {
      const fs::path dir = fs::path(path).parent_path();
      const fs::path merges = dir / (name == "vocab.json" ? "merges.txt" : "vocab.bpe");
      FOCUS_CHECK(fs::exists(merges), path, ": needs ", merges.string(), " beside it");
      return build(vocab_from_gpt2_files(path, merges.string()), path);
    }
    return build(vocab_from_hf_json(path), path);
  }
  return build(vocab_from_llama2c(path, vocab_size), path);
}

}  // namespace focus::io
