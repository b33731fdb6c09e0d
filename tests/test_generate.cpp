// Generation (model/generate.h) on the real stories260K model: greedy decoding over the KV cache
// picks the argmax of a full forward pass over the prompt and the tokens so far; sampling is
// softmax(logits / T) with a seeded generator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/progress.h"
#include "io/text.h"
#include "focus/focus_attention.h"
#include "model/generate.h"
#include "test_util.h"

using namespace focus;
using focus::test::book;
using focus::test::stories;

namespace {

std::unique_ptr<Model> stories_model() { return load_model(stories()); }

std::vector<int32_t> prompt_of(const Model& m, const std::string& text) { return encode_prompt(m, text); }

// The argmax (first on ties) of each row of the logits of one full pass over `ids` from an empty
// cache: row r is the model's next token after ids[0..r].
std::vector<int32_t> full_pass_argmax(const Model& m, const std::vector<int32_t>& ids, const AttentionPlan* plan) {
  const int64_t T = (int64_t)ids.size(), V = m.cfg.vocab;
  KVCache cache;
  cache.init(m.cfg, T);
  std::vector<float> hidden(T * m.cfg.dim), logits(T * V);
  forward(m, ids.data(), T, cache, hidden.data(), plan);
  compute_logits(m, hidden.data(), T, logits.data());
  std::vector<int32_t> out(T);
  for (int64_t r = 0; r < T; ++r)
    out[r] = (int32_t)(std::max_element(logits.begin() + r * V, logits.begin() + (r + 1) * V) - (logits.begin() + r * V));
  return out;
}

void expect_greedy_chain(const Model& m, const GenerateResult& r, const AttentionPlan* plan) {
  const std::vector<int32_t> ref = full_pass_argmax(m, r.tokens, plan);
  for (size_t i = r.prompt_tokens; i < r.tokens.size(); ++i)
    EXPECT_EQ(r.tokens[i], ref[i - 1]) << "generated token " << i - r.prompt_tokens;
}

std::string error_of(const Model& m, const std::vector<int32_t>& prompt, const GenerateOptions& o) {
  return focus::test::error_of([&] { generate(m, prompt, o); });
}

}  // namespace

TEST(Generate, GreedyIsTheArgmaxOfAFullPassAtEveryStep) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "Once upon a time, there was a little girl");
  GenerateOptions o;
  o.max_new_tokens = 40;
  o.stop_at_eos = false;
  const GenerateResult r = generate(*m, prompt, o);
  ASSERT_EQ(r.generated, 40);
  ASSERT_EQ(r.tokens.size(), prompt.size() + 40);
  EXPECT_TRUE(std::equal(prompt.begin(), prompt.end(), r.tokens.begin()));
  EXPECT_FALSE(r.eos || r.context_full || r.stopped);
  expect_greedy_chain(*m, r, nullptr);
}

TEST(Generate, GreedyWithHardFocusRoutersMatchesAFullPassWithThem) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  FocusSettings s;
  s.local_window = 16;
  s.sinks = 1;
  s.groups = 4;
  s.dg = 8;
  s.mode = FocusMode::Hard;
  const FocusRouters f = focus_init(m->cfg, s, 5);
  const AttentionPlan plan = focus_plan(m->cfg, f);
  // a prompt longer than the window, so prefill and decoding both run the sparse pattern
  std::vector<int32_t> prompt = prompt_of(*m, io::load_text(book("pg-345-dracula.txt")));
  prompt.resize(40);
  GenerateOptions o;
  o.max_new_tokens = 30;
  o.stop_at_eos = false;
  o.attention = &plan;
  const GenerateResult r = generate(*m, prompt, o);
  ASSERT_EQ(r.generated, 30);
  EXPECT_GT(r.decode_stats.layers, 0);
  expect_greedy_chain(*m, r, &plan);
}

TEST(Generate, SeededSamplingRepeatsForASeedAndDiffersAcrossSeeds) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "Once upon a time");
  GenerateOptions o;
  o.max_new_tokens = 48;
  o.temperature = 1.0f;
  o.stop_at_eos = false;
  o.seed = 11;
  const GenerateResult a = generate(*m, prompt, o), b = generate(*m, prompt, o);
  EXPECT_EQ(a.tokens, b.tokens);
  o.seed = 12;
  const GenerateResult c = generate(*m, prompt, o);
  EXPECT_NE(a.tokens, c.tokens);
  o.temperature = 0.f;
  const GenerateResult greedy = generate(*m, prompt, o);
  EXPECT_NE(a.tokens, greedy.tokens);  // temperature 1 does sample
}

TEST(Generate, TemperatureZeroIsGreedyWhateverTheSeedAndATinyTemperatureAgrees) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "The dog");
  GenerateOptions o;
  o.max_new_tokens = 24;
  o.stop_at_eos = false;
  o.seed = 1;
  const GenerateResult g1 = generate(*m, prompt, o);
  o.seed = 99;
  const GenerateResult g2 = generate(*m, prompt, o);
  EXPECT_EQ(g1.tokens, g2.tokens);
  expect_greedy_chain(*m, g1, nullptr);
  o.temperature = 1e-4f;  // softmax(l / T) puts all its mass on the argmax
  const GenerateResult tiny = generate(*m, prompt, o);
  EXPECT_EQ(tiny.tokens, g1.tokens);
}

TEST(Generate, SampleTokenDrawsFromTheTemperedSoftmax) {
  const std::vector<float> logits = {1.0f, 2.5f, -1.0f, 0.0f, 2.0f};
  const float T = 1.7f;
  std::vector<double> p(logits.size());
  double z = 0;
  for (size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(logits[i] / T);
  for (auto& x : p) x /= z;
  std::mt19937_64 rng(3);
  const int draws = 200000;
  std::vector<int> count(logits.size());
  for (int i = 0; i < draws; ++i) ++count[sample_token(logits.data(), (int64_t)logits.size(), T, rng)];
  for (size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(count[i] / (double)draws, p[i], 0.005) << "token " << i;
  // temperature 0: the first largest logit, the generator untouched
  const std::vector<float> tie = {0.f, 3.f, 3.f, 1.f};
  std::mt19937_64 a(5), b(5);
  EXPECT_EQ(sample_token(tie.data(), 4, 0.f, a), 1);
  EXPECT_EQ(a(), b());
}

TEST(Generate, CallbackStreamsEachTokenAndCanStop) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "Once upon a time");
  std::vector<std::pair<int32_t, int32_t>> seen;
  GenerateOptions o;
  o.max_new_tokens = 20;
  o.stop_at_eos = false;
  o.on_token = [&](int32_t t, int32_t prev) {
    seen.push_back({t, prev});
    return seen.size() < 5;
  };
  const GenerateResult r = generate(*m, prompt, o);
  EXPECT_TRUE(r.stopped);
  ASSERT_EQ(r.generated, 5);
  ASSERT_EQ(seen.size(), 5u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].first, r.tokens[prompt.size() + i]);
    EXPECT_EQ(seen[i].second, r.tokens[prompt.size() + i - 1]);
  }
}

TEST(Generate, AStopRequestEndsGenerationBeforeTheNextToken) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "Once upon a time");
  GenerateOptions o;
  o.max_new_tokens = 6;
  o.stop_at_eos = false;
  request_interrupt();
  const GenerateResult r = generate(*m, prompt, o);
  clear_interrupt();
  EXPECT_TRUE(r.stopped);
  EXPECT_EQ(r.generated, 0);
  EXPECT_EQ(r.tokens, prompt);
  const GenerateResult again = generate(*m, prompt, o);
  EXPECT_FALSE(again.stopped);
  EXPECT_EQ(again.generated, 6);
}

TEST(Generate, StopsAtTheModelsContextAndGeneratesNothingForZero) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const int64_t ctx = m->cfg.max_ctx;
  ASSERT_GT(ctx, 8);
  std::vector<int32_t> prompt = prompt_of(*m, io::load_text(book("pg-345-dracula.txt")));
  ASSERT_GT((int64_t)prompt.size(), ctx);
  prompt.resize(ctx - 3);
  GenerateOptions o;
  o.max_new_tokens = 10;
  o.stop_at_eos = false;
  const GenerateResult r = generate(*m, prompt, o);
  EXPECT_TRUE(r.context_full);
  EXPECT_EQ(r.generated, 3);
  EXPECT_EQ((int64_t)r.tokens.size(), ctx);
  expect_greedy_chain(*m, r, nullptr);

  o.max_new_tokens = 0;
  const GenerateResult none = generate(*m, prompt, o);
  EXPECT_EQ(none.generated, 0);
  EXPECT_EQ(none.tokens, prompt);
}

TEST(Generate, BadArgumentsAreClearErrors) {
  FOCUS_NEED_FILE(stories());
  auto m = stories_model();
  const std::vector<int32_t> prompt = prompt_of(*m, "Once");
  GenerateOptions o;
  o.max_new_tokens = -1;
  EXPECT_NE(error_of(*m, prompt, o).find("number of tokens must be >= 0, got -1"), std::string::npos);
  o.max_new_tokens = 4;
  EXPECT_NE(error_of(*m, {}, o).find("empty prompt"), std::string::npos);
  o.temperature = -0.5f;
  EXPECT_NE(error_of(*m, prompt, o).find("temperature must be >= 0"), std::string::npos);
  o.temperature = std::nanf("");
  EXPECT_NE(error_of(*m, prompt, o).find("temperature must be >= 0"), std::string::npos);
  o.temperature = 0.f;
  EXPECT_NE(error_of(*m, {1, 512}, o).find("token 512 is outside the vocabulary (512)"), std::string::npos);
  EXPECT_NE(error_of(*m, std::vector<int32_t>(m->cfg.max_ctx, 1), o).find("fills the model's context"),
            std::string::npos);
  EXPECT_EQ(encode_prompt(*m, ""), std::vector<int32_t>{m->tok->bos()});  // an empty text is BOS alone
}
