// Byte-level BPE (GPT-2 style): a hand-written regex pre-tokenizer splits the text, then ranked
// merges run over GPT-2's byte alphabet within each pre-token.
#include <cstdio>
#include <mutex>
#include <set>

#include "core/error.h"
#include "io/tokenizer_bpe_common.h"
#include "io/unicode.h"

namespace focus::io::bpe {
namespace {

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

}  // namespace

std::unique_ptr<Tokenizer> make_byte_bpe(const VocabData& v, const std::string& source) {
  return std::make_unique<ByteBPETokenizer>(v, source);
}

}  // namespace focus::io::bpe
