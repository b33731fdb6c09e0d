// Training data: documents (one text file each) tokenized once, windows drawn from them.
// Train and validation are split by document, so a book is never on both sides.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "io/tokenizer.h"

namespace focus {

struct TokenDoc {
  std::string path;
  std::vector<int32_t> ids;  // text tokens, no BOS
};

// Prepares (Gutenberg boilerplate, BOM, CRLF) and tokenizes each file; errors name the file.
std::vector<TokenDoc> tokenize_docs(const io::Tokenizer& tok, const std::vector<std::string>& files);

// One training or validation window: [BOS] + doc.ids[start, start + len).
struct WindowRef {
  int32_t doc = 0;
  int64_t start = 0;
};

struct Window {
  std::vector<int32_t> ids;      // model input, length T (BOS first when the model has one)
  std::vector<int32_t> targets;  // targets[t] = token predicted at row t (-1: not scored)
};

// Window of ctx positions starting at ref; the last row has no target.
Window make_window(const std::vector<TokenDoc>& docs, const WindowRef& ref, int64_t ctx, int32_t bos);

// The window of training step `step`, batch slot `b`: a deterministic function of (seed, step, b),
// uniform over all start positions of all documents, so a resumed run sees the same windows.
WindowRef sample_window(const std::vector<TokenDoc>& docs, int64_t ctx, int32_t bos, uint64_t seed, int64_t step,
                        int64_t b);

// Up to n windows spread evenly over the documents (the same every time).
std::vector<WindowRef> validation_windows(const std::vector<TokenDoc>& docs, int64_t ctx, int32_t bos, int64_t n);

int64_t total_tokens(const std::vector<TokenDoc>& docs);

}  // namespace focus
