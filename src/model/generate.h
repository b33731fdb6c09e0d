// Text generation: prompt prefill, then one token at a time over the KV cache, greedy or
// sampled at a temperature from a seeded generator.
#pragma once
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "model/model.h"

namespace focus {

struct GenerateOptions {
  int64_t max_new_tokens = 64;  // n >= 0; the model's context can end generation sooner
  float temperature = 0.f;      // 0: greedy (argmax); > 0: sample from softmax(logits / temperature)
  uint64_t seed = 1;            // sampling seed (the same seed gives the same tokens)
  bool stop_at_eos = true;      // end after the tokenizer's EOS (which is kept in the output)
  const AttentionPlan* attention = nullptr;  // per-layer attention (e.g. Focus routers), or the model's own
  cpu::KvType kv_type = cpu::KvType::F32;    // the KV cache's element type
  // Called after each new token with it and the token before it (for a tokenizer's piece);
  // returning false stops generation after this token.
  std::function<bool(int32_t token, int32_t previous)> on_token;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // prompt followed by the generated tokens
  int64_t prompt_tokens = 0, generated = 0;
  double prefill_seconds = 0, decode_seconds = 0;
  AttentionStats decode_stats;  // density of the sparse pattern the decoding steps read
  bool eos = false;          // ended on EOS
  bool context_full = false; // ended because the model's context is full
  bool stopped = false;      // ended by on_token or interrupted()
};

// The prompt's tokens: with BOS when the tokenizer adds one by default or the text is empty.
// Throws Error when the model has no tokenizer, or the prompt is empty and there is no BOS.
std::vector<int32_t> encode_prompt(const Model& m, const std::string& text);

// Generates up to o.max_new_tokens tokens after `prompt` (non-empty, shorter than the model's
// context). Each step runs forward() on the new token against the cache of the earlier ones and
// picks the next token from the last position's logits. Stops early on EOS (o.stop_at_eos and a
// tokenizer with one), when the context is full, when on_token returns false, or when
// interrupted() is set. Throws Error on bad arguments.
GenerateResult generate(const Model& m, const std::vector<int32_t>& prompt, const GenerateOptions& o);

// The next token from logits[0, vocab): the first index of the largest logit at temperature 0,
// else a draw from softmax(logits / temperature) with `rng`.
int32_t sample_token(const float* logits, int64_t vocab, float temperature, std::mt19937_64& rng);

}  // namespace focus
