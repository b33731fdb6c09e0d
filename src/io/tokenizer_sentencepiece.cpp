// SentencePiece-style BPE: score-ordered merges over UTF-8 characters, with byte fallback
// (llama2.c tokenizer files, GGUF "llama" vocabularies).
#include <deque>
#include <unordered_set>

#include "core/error.h"
#include "io/tokenizer_bpe_common.h"
#include "io/unicode.h"

namespace focus::io::bpe {
namespace {

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

}  // namespace

std::unique_ptr<Tokenizer> make_sentencepiece(const VocabData& v, const std::string& source) {
  return std::make_unique<SentencePieceTokenizer>(v, source);
}

}  // namespace focus::io::bpe
