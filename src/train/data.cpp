#include "train/data.h"

#include <algorithm>

#include "core/error.h"
#include "io/text.h"

namespace focus {

std::vector<TokenDoc> tokenize_docs(const io::Tokenizer& tok, const std::vector<std::string>& files) {
  std::vector<TokenDoc> docs;
  for (const auto& f : files) {
    TokenDoc d;
    d.path = f;
    d.ids = tok.encode(io::load_text(f), false);
    FOCUS_CHECK(!d.ids.empty(), f, ": the text encodes to no tokens");
    docs.push_back(std::move(d));
  }
  return docs;
}

int64_t total_tokens(const std::vector<TokenDoc>& docs) {
  int64_t n = 0;
  for (const auto& d : docs) n += (int64_t)d.ids.size();
  return n;
}

namespace {
// Text tokens a window of ctx positions holds.
int64_t span_of(int64_t ctx, int32_t bos) { return bos >= 0 ? ctx - 1 : ctx; }

// Number of start positions of doc d (0 if it is shorter than a window).
int64_t starts_of(const TokenDoc& d, int64_t span) { return std::max<int64_t>(0, (int64_t)d.ids.size() - span + 1); }

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
}  // namespace

Window make_window(const std::vector<TokenDoc>& docs, const WindowRef& ref, int64_t ctx, int32_t bos) {
  const TokenDoc& d = docs.at(ref.doc);
  const int64_t span = span_of(ctx, bos);
  FOCUS_CHECK(ref.start >= 0 && ref.start + span <= (int64_t)d.ids.size(), d.path, ": window [", ref.start, ", ",
              ref.start + span, ") is outside the document (", d.ids.size(), " tokens)");
  Window w;
  if (bos >= 0) w.ids.push_back(bos);
  w.ids.insert(w.ids.end(), d.ids.begin() + ref.start, d.ids.begin() + ref.start + span);
  w.targets.assign(w.ids.size(), -1);
  for (size_t t = 0; t + 1 < w.ids.size(); ++t) w.targets[t] = w.ids[t + 1];
  return w;
}

WindowRef sample_window(const std::vector<TokenDoc>& docs, int64_t ctx, int32_t bos, uint64_t seed, int64_t step,
                        int64_t b) {
  const int64_t span = span_of(ctx, bos);
  int64_t total = 0;
  for (const auto& d : docs) total += starts_of(d, span);
  FOCUS_CHECK(total > 0, "training data: no document holds a full window of ", ctx, " tokens");
  int64_t r = (int64_t)(mix(mix(seed) ^ mix((uint64_t)step * 1315423911ull + (uint64_t)b)) % (uint64_t)total);
  for (int32_t i = 0; i < (int32_t)docs.size(); ++i) {
    const int64_t s = starts_of(docs[i], span);
    if (r < s) return {i, r};
    r -= s;
  }
  return {0, 0};  // unreachable
}

std::vector<WindowRef> validation_windows(const std::vector<TokenDoc>& docs, int64_t ctx, int32_t bos, int64_t n) {
  const int64_t span = span_of(ctx, bos);
  std::vector<WindowRef> out;
  // Non-overlapping windows in every document, then an even subsample of them.
  std::vector<WindowRef> all;
  for (int32_t i = 0; i < (int32_t)docs.size(); ++i)
    for (int64_t s = 0; s + span <= (int64_t)docs[i].ids.size(); s += span) all.push_back({i, s});
  FOCUS_CHECK(!all.empty(), "validation data: no document holds a full window of ", ctx, " tokens");
  if ((int64_t)all.size() <= n) return all;
  for (int64_t k = 0; k < n; ++k) out.push_back(all[(size_t)(k * (int64_t)all.size() / n)]);
  return out;
}

}  // namespace focus
