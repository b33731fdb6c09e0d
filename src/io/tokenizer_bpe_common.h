// Pieces both BPE tokenizers share (token types, GPT-2's byte alphabet, user-defined tokens,
// the priority-queue merge over a linked list of symbols) and the constructors of the two
// tokenizer kinds. Internal to the tokenizer sources.
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/tokenizer.h"

namespace focus::io::bpe {

// GGUF token types.
inline constexpr int32_t kTypeNormal = 1, kTypeUnknown = 2, kTypeControl = 3, kTypeUser = 4, kTypeUnused = 5,
                  kTypeByte = 6;

inline constexpr const char* kSpaceMarker = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space

// GPT-2 maps every byte to a printable code point so that token text never holds raw
// control bytes or spaces: printable Latin-1 bytes map to themselves, the rest to 256+n.
struct ByteUnicode {
  std::array<std::string, 256> encode;       // byte -> UTF-8 of its code point
  std::unordered_map<uint32_t, uint8_t> decode;  // code point -> byte
  ByteUnicode();
};
const ByteUnicode& byte_unicode();

// "<0xNN>" -> NN, or -1.
int parse_byte_token(std::string_view s);

void replace_all(std::string& s, std::string_view from, std::string_view to);

// Token types with defaults filled in when the source gave none.
std::vector<int32_t> effective_types(const VocabData& v);

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

// The tokenizers (tokenizer_byte_bpe.cpp, tokenizer_sentencepiece.cpp); `source` names the file in errors.
std::unique_ptr<Tokenizer> make_byte_bpe(const VocabData& v, const std::string& source);
std::unique_ptr<Tokenizer> make_sentencepiece(const VocabData& v, const std::string& source);

}  // namespace focus::io::bpe
