// Attention as a pluggable policy (model/attention.h): a variant defined and registered in this
// file alone runs inside the model's forward pass, keeps its own state in the KV cache, and gives
// the numbers of an independent computation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <vector>

#include "core/error.h"
#include "model/attention.h"
#include "model/model.h"
#include "test_util.h"

using namespace focus;
using focus::test::stories;

namespace {

// Each query reads only its own key: out[t, h] = v[pos0 + t, kv head of h]. Counts the rows it
// has seen in a state of its own, kept in the KV cache.
struct SelfRows final : AttentionState {
  int64_t rows = 0;
  void truncate(int64_t n) override { rows = std::min(rows, n); }
};

class SelfOnlyAttention final : public AttentionPolicy {
 public:
  std::string name() const override { return "test-self-only"; }
  void attend(const AttentionCall& c, std::unique_ptr<AttentionState>& state, AttentionStats*) const override {
    if (c.pos0 == 0 || !state) state = std::make_unique<SelfRows>();
    auto& s = dynamic_cast<SelfRows&>(*state);
    ASSERT_EQ(s.rows, c.pos0) << "the cache's state follows its positions";
    s.rows += c.T;
    const ModelConfig& m = *c.cfg;
    const int64_t per_kv = m.heads / m.kv_heads;
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t h = 0; h < m.heads; ++h) {
        const float* v = c.v + (c.pos0 + t) * m.kv_dim() + (h / per_kv) * m.head_dim;
        std::copy(v, v + m.head_dim, c.out + t * m.q_dim() + h * m.head_dim);
      }
    calls++;
  }
  static inline std::atomic<int64_t> calls{0};
};

// The one line that makes the variant available by name.
const bool registered = register_attention_policy(
    "test-self-only", [](const ModelConfig&, int64_t, const AttentionOptions&) { return std::make_shared<SelfOnlyAttention>(); });

std::vector<int32_t> some_ids(int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(n);
  for (int64_t i = 0; i < n; ++i) ids[i] = (int32_t)((i * 131 + 7) % vocab);
  ids[0] = 1;
  return ids;
}

std::vector<float> run(const Model& m, const std::vector<int32_t>& ids, const AttentionPlan* plan) {
  KVCache c;
  c.init(m.cfg, (int64_t)ids.size());
  std::vector<float> h(ids.size() * m.cfg.dim);
  forward(m, ids.data(), (int64_t)ids.size(), c, h.data(), plan);
  return h;
}

}  // namespace

TEST(AttentionPolicy, RegisteredVariantIsListedAndPlannedOnEveryGlobalLayer) {
  ASSERT_TRUE(registered);
  const auto names = registered_attention_policies();
  EXPECT_NE(std::find(names.begin(), names.end(), "test-self-only"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "dense"), names.end());
  ModelConfig c;
  c.layers = 4;
  c.layer_sliding_window = {0, 512, 0, 512};  // two sliding-window layers stay dense
  const AttentionPlan plan = make_attention_plan(c, "test-self-only");
  ASSERT_EQ((int64_t)plan.layers.size(), 4);
  EXPECT_EQ(plan.at(0).name(), "test-self-only");
  EXPECT_EQ(plan.at(1).name(), "dense");
  EXPECT_EQ(plan.at(2).name(), "test-self-only");
  EXPECT_EQ(plan.at(3).name(), "dense");
  EXPECT_EQ(make_attention_plan(c, "dense").at(0).name(), "dense");
  EXPECT_THROW(make_attention_plan(c, "no-such-policy"), Error);
  EXPECT_THROW(register_attention_policy("test-self-only", [](const ModelConfig&, int64_t, const AttentionOptions&) {
                 return std::make_shared<SelfOnlyAttention>();
               }),
               Error);
}

// The model run with the toy policy equals the same model whose layers have a sliding window of
// one key (the dense kernel, where softmax over one key gives that key's value): the policy ran
// on every layer, in one call and token by token from the cache.
TEST(AttentionPolicy, ToyVariantRunsInTheForwardPassAndDecodesFromItsState) {
  FOCUS_NEED_FILE(stories());
  auto m = load_model(stories(), LoadOptions{"", false});
  const int64_t n = 40, D = m->cfg.dim;
  const auto ids = some_ids(n, m->cfg.vocab);
  const AttentionPlan plan = make_attention_plan(m->cfg, "test-self-only");
  const int64_t calls0 = SelfOnlyAttention::calls;
  const auto toy = run(*m, ids, &plan);
  EXPECT_EQ(SelfOnlyAttention::calls - calls0, m->cfg.layers);
  const auto dense = run(*m, ids, nullptr);

  // Token by token over the cache, with a truncation in between (the state follows it).
  KVCache c;
  c.init(m->cfg, n);
  std::vector<float> h(n * D);
  forward(*m, ids.data(), 20, c, h.data(), &plan);
  c.truncate(12);
  for (int64_t i = 12; i < n; ++i) forward(*m, ids.data() + i, 1, c, h.data() + i * D, &plan);

  m->cfg.layer_sliding_window.assign(m->cfg.layers, 1);
  const auto window1 = run(*m, ids, nullptr);
  double err = 0, err_dec = 0, diff_dense = 0;
  for (int64_t i = 0; i < n * D; ++i) {
    err = std::max(err, (double)std::fabs(toy[i] - window1[i]));
    if (i >= 12 * D) err_dec = std::max(err_dec, (double)std::fabs(h[i] - window1[i]));
    diff_dense = std::max(diff_dense, (double)std::fabs(toy[i] - dense[i]));
  }
  EXPECT_LT(err, 1e-5);
  EXPECT_LT(err_dec, 1e-5);
  EXPECT_GT(diff_dense, 1e-2);  // the variant really changed the model's attention
}

// A policy that has no training form says so instead of training something else.
TEST(AttentionPolicy, UntrainableVariantRefusesTraining) {
  SelfOnlyAttention p;
  AttentionCall c;
  AttentionTape tape;
  EXPECT_THROW(p.train_forward(c, tape), Error);
  EXPECT_FALSE(p.trains_parameters());
}
