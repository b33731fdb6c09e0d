#include "model/generate.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "core/progress.h"
#include "kernels/cpu/ops.h"

namespace focus {

int32_t sample_token(const float* logits, int64_t vocab, float temperature, std::mt19937_64& rng) {
  FOCUS_CHECK(vocab >= 1, "sample_token: empty logits");
  FOCUS_CHECK(temperature >= 0.f, "temperature must be >= 0 (0: greedy), got ", temperature);
  const float* top = std::max_element(logits, logits + vocab);
  if (temperature == 0.f) return (int32_t)(top - logits);
  std::vector<double> p(vocab);
  for (int64_t i = 0; i < vocab; ++i) p[i] = std::exp((logits[i] - *top) / temperature);
  std::discrete_distribution<int32_t> d(p.begin(), p.end());
  return d(rng);
}

std::vector<int32_t> encode_prompt(const Model& m, const std::string& text) {
  FOCUS_CHECK(m.tok, m.path, ": the model has no tokenizer to encode the prompt");
  std::vector<int32_t> ids = m.tok->encode(text, m.tok->add_bos_default() || text.empty());
  FOCUS_CHECK(!ids.empty(), "generate: empty prompt and the model has no BOS token");
  return ids;
}

GenerateResult generate(const Model& m, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  FOCUS_CHECK(o.max_new_tokens >= 0, "generate: the number of tokens must be >= 0, got ", o.max_new_tokens);
  FOCUS_CHECK(o.temperature >= 0.f, "generate: temperature must be >= 0 (0: greedy), got ", o.temperature);
  FOCUS_CHECK(!prompt.empty(), "generate: empty prompt (give at least one token, e.g. BOS)");
  const int64_t vocab = m.cfg.vocab, dim = m.cfg.dim;
  for (int32_t t : prompt) FOCUS_CHECK(t >= 0 && t < vocab, "generate: prompt token ", t, " is outside the vocabulary (", vocab, ")");
  const int64_t P = (int64_t)prompt.size();
  const int64_t limit = m.cfg.max_ctx > 0 ? m.cfg.max_ctx : int64_t{1} << 20;
  FOCUS_CHECK(P < limit, "generate: the prompt (", P, " tokens) fills the model's context (", limit, ")");

  GenerateResult r;
  r.tokens = prompt;
  r.prompt_tokens = P;
  if (o.max_new_tokens == 0) return r;
  const int64_t cap = std::min(P + o.max_new_tokens, limit);
  check_inference_memory("generate (" + std::to_string(P) + " prompt tokens + " + std::to_string(cap - P) + " new)",
                         m.cfg, cap, P, o.kv_type, 1,
                         "generate fewer tokens (-n) or shorten the prompt (the KV cache holds both)",
                         decode_kv_copies(m.cfg, o.attention));
  const int32_t eos = m.tok ? m.tok->eos() : -1;

  KVCache cache;
  cache.init(m.cfg, cap, o.kv_type);
  std::vector<float> hidden(P * dim), logits(vocab);
  std::mt19937_64 rng(o.seed);
  const auto t0 = std::chrono::steady_clock::now();
  // A NaN or an infinity in the last hidden state (from the weights or the activations) would be
  // sampled from as if it were logits: stop with the position instead.
  auto check_finite = [&](const float* h, int64_t pos) {
    FOCUS_CHECK(cpu::all_finite(h, dim), m.path, ": non-finite hidden state at position ", pos,
                " (NaN or Inf in the weights or activations)");
  };
  forward(m, prompt.data(), P, cache, hidden.data(), o.attention);
  check_finite(hidden.data() + (P - 1) * dim, P - 1);
  compute_logits(m, hidden.data() + (P - 1) * dim, 1, logits.data());
  const auto t1 = std::chrono::steady_clock::now();
  r.prefill_seconds = std::chrono::duration<double>(t1 - t0).count();
  while (true) {
    if (interrupted()) {
      r.stopped = true;
      break;
    }
    int32_t next = sample_token(logits.data(), vocab, o.temperature, rng);
    const int32_t prev = r.tokens.back();
    r.tokens.push_back(next);
    ++r.generated;
    const bool go_on = !o.on_token || o.on_token(next, prev);
    if (o.stop_at_eos && eos >= 0 && next == eos) {
      r.eos = true;
      break;
    }
    if (!go_on) {
      r.stopped = true;
      break;
    }
    if (r.generated >= o.max_new_tokens) break;
    if ((int64_t)r.tokens.size() >= cap) {
      r.context_full = true;
      break;
    }
    forward(m, &next, 1, cache, hidden.data(), o.attention, &r.decode_stats);
    check_finite(hidden.data(), (int64_t)r.tokens.size() - 1);
    compute_logits(m, hidden.data(), 1, logits.data());
  }
  r.decode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  return r;
}

}  // namespace focus
