// Training from scratch: the gradient of every weight of the model (embeddings, norms, QK norms,
// projections, MLP, output) against central differences of the float32 loss, on each attention
// architecture the trainer builds (MHA, GQA, MQA, local/global, MLA); the saved folder loads back
// as the same model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "core/rng.h"
#include "model/model.h"
#include "test_models.h"
#include "test_util.h"
#include "eval/perplexity.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "train/backward.h"
#include "train/model_params.h"
#include "train/retrofit.h"

namespace focus {
namespace {

namespace fs = std::filesystem;

// A tiny model of the preset's architecture with random weights, norms away from 1 so their
// gradients are tested in general position.
ModelParams tiny_params(const std::string& arch, uint64_t seed) {
  ModelConfig c = preset_config(arch, 37, 64);
  c.dim = 16;
  c.layers = 2;
  c.heads = 4;
  c.head_dim = 4;
  c.kv_heads = arch == "mha" ? 4 : arch == "mqa" ? 1 : 2;
  c.ffn = 24;
  c.rope_dim = c.head_dim;
  c.attn_scale = 0.5f;
  c.layer_sliding_window.assign(c.layers, 0);
  if (c.arch == Arch::Gemma3) {
    c.embed_scale = 4.f;
    c.layer_sliding_window = {5, 0};  // a window shorter than the test window, then global
  }
  if (c.mla()) {  // latent 8, query latent 6, per head 4 + 4 (RoPE) query-key dims and 6 value dims
    c.mla_kv_rank = 8;
    c.mla_q_rank = 6;
    c.mla_nope = 4;
    c.mla_rope = 4;
    c.mla_v = 6;
    apply_arch_defaults(c);  // the absorbed head and its scale
  }
  ModelParams p = init_model_params(c, seed);
  Rng rng{seed + 17};
  for (size_t i = 0; i < p.data.size(); ++i) {
    const bool norm = p.tensors[i].shape.size() == 1;
    for (float& x : p.data[i]) x = norm ? (float)(1.0 + 0.3 * rng.normal()) : (float)(0.2 * rng.normal());
  }
  return p;
}

// f'(0) by central differences at steps 2h and h combined to cancel the h^2 term (Richardson):
// attention's curvature makes a plain central difference at a step float32 can resolve too coarse.
template <class F>
double derivative(F&& f, double h = 1e-3) {
  const double d2 = (f(2 * h) - f(-2 * h)) / (4 * h), d1 = (f(h) - f(-h)) / (2 * h);
  return (4 * d1 - d2) / 3;
}

double loss_of(const ModelParams& p, const TrainWindow& w) {
  Model m;
  bind_model(p, m);
  return train_loss(m, TrainableSet{}, w);
}

// Random soft routers on the tiny model: window 3, 3 groups, d_g 4, temperature 0.5.
FocusRouters soft_routers(const ModelConfig& c) {
  FocusSettings s;
  s.mode = FocusMode::Soft;
  s.local_window = 3;
  s.groups = 3;
  s.dg = 4;
  s.tau = 0.5f;
  return focus_init(c, s, 2);
}

// Zeroed gradient buffers of the model and the routers, and the set that trains both.
struct JointGrads {
  std::vector<std::vector<float>> g, gr;
  ModelGrads mg;
  TrainableSet ts;
  JointGrads(const ModelParams& p, const FocusRouters& f) {
    mg = bind_grads(p, g);
    for (const auto& r : f.routers) gr.emplace_back(r.params.size(), 0.f);
    ts.model_grads = &mg;
    ts.routers = &f;
    ts.router_grads = &gr;
  }
  JointGrads(const JointGrads&) = delete;
  JointGrads& operator=(const JointGrads&) = delete;
};

class FullModelGrad : public ::testing::TestWithParam<std::string> {};

TEST_P(FullModelGrad, EveryWeightMatchesFiniteDifferences) {
  const ModelParams p = tiny_params(GetParam(), 3);
  Model m;
  bind_model(p, m);
  const int64_t T = 13;
  const test::Win win = test::window_of(T, p.cfg.vocab, 11);
  const TrainWindow w{win.ids.data(), T, win.targets.data()};
  const float scale = 1.f / (T - 2);
  std::vector<std::vector<float>> g;
  const ModelGrads mg = bind_grads(p, g);
  TrainableSet ts;
  ts.model_grads = &mg;
  const LossGrad lg = train_loss_and_grad(m, ts, w, scale);
  EXPECT_NEAR(lg.loss_sum, loss_of(p, w), 1e-9 * lg.loss_sum) << "loss with and without gradients";

  // The whole gradient along its own direction.
  double gall = 0;
  for (const auto& v : g)
    for (float x : v) gall += (double)x * x;
  gall = std::sqrt(gall);
  const double fd_all = derivative([&](double t) {
    ModelParams q = p;
    for (size_t k = 0; k < g.size(); ++k)
      for (size_t i = 0; i < g[k].size(); ++i) q.data[k][i] += (float)(t * g[k][i] / gall);
    return loss_of(q, w) * scale;
  });
  EXPECT_NEAR(fd_all, gall, 3e-3 * gall + 3e-4) << "the whole gradient along itself";
  // Each tensor: along its own gradient, and its two largest coordinates one at a time.
  for (size_t k = 0; k < g.size(); ++k) {
    const std::string& name = p.tensors[k].name;
    double gn = 0;
    for (float x : g[k]) gn += (double)x * x;
    gn = std::sqrt(gn);
    ASSERT_GT(gn, 1e-5) << name << ": no gradient reached it";
    auto along = [&](double t) {
      ModelParams q = p;
      for (size_t i = 0; i < g[k].size(); ++i) q.data[k][i] += (float)(t * g[k][i] / gn);
      return loss_of(q, w) * scale;
    };
    EXPECT_NEAR(derivative(along), gn, 3e-3 * gn + 3e-4) << name << ": along its gradient";
    std::vector<size_t> idx(g[k].size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    const size_t top = std::min<size_t>(2, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + top, idx.end(),
                      [&](size_t a, size_t b) { return std::abs(g[k][a]) > std::abs(g[k][b]); });
    for (size_t j = 0; j < top; ++j) {
      const size_t i = idx[j];
      auto at = [&](double t) {
        ModelParams q = p;
        q.data[k][i] += (float)t;
        return loss_of(q, w) * scale;
      };
      EXPECT_NEAR(derivative(at), g[k][i], 5e-3 * std::abs(g[k][i]) + 3e-4) << name << "[" << i << "]";
    }
  }
}

// Training jointly with Focus routers (soft attention, the additive log-bias beyond the window):
// the model's and the routers' gradients together against a central difference along them.
TEST_P(FullModelGrad, JointWithSoftRoutersMatchesFiniteDifferences) {
  const ModelParams p = tiny_params(GetParam(), 6);
  Model m;
  bind_model(p, m);
  const FocusRouters f = soft_routers(p.cfg);
  ASSERT_FALSE(f.routers.empty());
  const int64_t T = 13;
  const test::Win win = test::window_of(T, p.cfg.vocab, 4);
  const TrainWindow w{win.ids.data(), T, win.targets.data()};
  const float scale = 1.f / (T - 2);
  JointGrads J(p, f);
  train_loss_and_grad(m, J.ts, w, scale);
  const auto &g = J.g, &gr = J.gr;
  double gn = 0;
  for (const auto* v : {&g, &gr})
    for (const auto& b : *v)
      for (float x : b) gn += (double)x * x;
  gn = std::sqrt(gn);
  ASSERT_GT(gn, 1e-4);
  double router_gn = 0;
  for (const auto& b : gr)
    for (float x : b) router_gn += (double)x * x;
  EXPECT_GT(router_gn, 1e-12) << "no gradient reached the routers";
  const double fd = derivative([&](double t) {
    ModelParams q = p;
    FocusRouters f2 = f;
    for (size_t k = 0; k < g.size(); ++k)
      for (size_t i = 0; i < g[k].size(); ++i) q.data[k][i] += (float)(t * g[k][i] / gn);
    for (size_t r = 0; r < gr.size(); ++r)
      for (size_t i = 0; i < gr[r].size(); ++i) f2.routers[r].params[i] += (float)(t * gr[r][i] / gn);
    Model m2;
    bind_model(q, m2);
    TrainableSet fwd;
    fwd.routers = &f2;
    return train_loss(m2, fwd, w) * scale;
  });
  EXPECT_NEAR(fd, gn, 3e-3 * gn + 3e-4) << "model and routers along their gradient";
}

// --router-detach: the routers still learn, but neither the LM loss nor the balancing term reaches
// the model through them, so the model's gradient does not depend on the balancing weight; without
// the stop-gradient it does (the test can fail).
TEST_P(FullModelGrad, DetachedRoutersPassNoGradientIntoTheModel) {
  const ModelParams p = tiny_params(GetParam(), 8);
  Model m;
  bind_model(p, m);
  const FocusRouters f = soft_routers(p.cfg);
  const int64_t T = 13;
  const test::Win win = test::window_of(T, p.cfg.vocab, 5);
  const TrainWindow w{win.ids.data(), T, win.targets.data()};
  double swav = 0;
  int64_t terms = 0;
  auto grads = [&](bool detach, float balance) {
    JointGrads J(p, f);
    J.ts.router_detach_input = detach;
    if (balance > 0) J.ts.router_hook = swav_balance_hook(f, balance, &swav, &terms);
    train_loss_and_grad(m, J.ts, w, 1.f / T);
    double router_norm = 0;
    for (const auto& b : J.gr)
      for (float x : b) router_norm += (double)x * x;
    EXPECT_GT(router_norm, 1e-12) << "the routers must still learn";
    return J.g;
  };
  auto max_diff = [](const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
    double d = 0;
    for (size_t k = 0; k < a.size(); ++k)
      for (size_t i = 0; i < a[k].size(); ++i) d = std::max(d, (double)std::fabs(a[k][i] - b[k][i]));
    return d;
  };
  EXPECT_EQ(max_diff(grads(true, 0.f), grads(true, 10.f)), 0.0);
  EXPECT_GT(max_diff(grads(false, 0.f), grads(false, 10.f)), 1e-6);
  EXPECT_GT(terms, 0) << "the balancing hook ran";
}

// Causality and one forward pass: at a length past the kernels' tiles, changing the last token
// leaves every earlier position's hidden state as it was, and the training forward pass (the
// loss the trainer minimises) scores what inference scores.
TEST_P(FullModelGrad, CausalAndTrainingScoresWhatInferenceScores) {
  const ModelParams p = tiny_params(GetParam(), 9);
  Model m;
  bind_model(p, m);
  const int64_t T = 150;
  test::Win a = test::window_of(T, p.cfg.vocab, 6);
  std::vector<int32_t> b = a.ids;
  b[T - 1] = (b[T - 1] + 1) % (int32_t)p.cfg.vocab;
  const std::vector<float> ha = test::hidden_of(m, a.ids, nullptr), hb = test::hidden_of(m, b, nullptr);
  const int64_t D = p.cfg.dim;
  EXPECT_TRUE(std::equal(ha.begin(), ha.begin() + (T - 1) * D, hb.begin())) << "a later token changed an earlier row";
  EXPECT_GT(test::max_abs_diff(ha, hb, (T - 1) * D), 0.0);
  int64_t n = 0;
  const double infer = window_nll(m, a.ids, a.targets, nullptr, nullptr, &n);
  EXPECT_NEAR(train_loss(m, TrainableSet{}, TrainWindow{a.ids.data(), T, a.targets.data()}), infer, 1e-4 * infer);
}

// Gradients accumulate: two windows' calls sum to the two calls' gradients.
TEST_P(FullModelGrad, GradientsAccumulateOverWindows) {
  const ModelParams p = tiny_params(GetParam(), 4);
  Model m;
  bind_model(p, m);
  const int64_t T = 9;
  const test::Win a = test::window_of(T, p.cfg.vocab, 1), b = test::window_of(T, p.cfg.vocab, 2);
  std::vector<std::vector<float>> ga, gb, gab;
  const ModelGrads ma = bind_grads(p, ga), mb = bind_grads(p, gb), mab = bind_grads(p, gab);
  for (auto [grads, wins] : {std::pair{&ma, std::vector<const test::Win*>{&a}}, {&mb, {&b}}, {&mab, {&a, &b}}}) {
    TrainableSet ts;
    ts.model_grads = grads;
    for (const test::Win* x : wins) train_loss_and_grad(m, ts, TrainWindow{x->ids.data(), T, x->targets.data()}, 1.f);
  }
  for (size_t k = 0; k < ga.size(); ++k)
    for (size_t i = 0; i < ga[k].size(); ++i)
      ASSERT_NEAR(gab[k][i], ga[k][i] + gb[k][i], 1e-5 * (1 + std::abs(gab[k][i]))) << p.tensors[k].name;
}

// The saved folder (safetensors + config.json + tokenizer) is the same model: load_model gives
// the logits of the in-memory one.
TEST_P(FullModelGrad, SavedModelLoadsBackAsTheSameModel) {
  const std::string tok = test::tok512();
  FOCUS_NEED_FILE(tok);
  ModelParams p = init_model_params(preset_config(GetParam(), 512, 64), 5);
  p.cfg.layers = 2;  // small: the first two layers of the preset
  p.cfg.layer_sliding_window.resize(2);
  if (p.cfg.arch == Arch::Gemma3) p.cfg.layer_sliding_window = {16, 0};
  p = init_model_params(p.cfg, 5);
  Model m;
  bind_model(p, m);
  const std::string dir = (fs::temp_directory_path() / ("saved_" + GetParam())).string();
  save_model_params(p, dir, tok);
  const auto loaded = load_model(dir, LoadOptions{});
  EXPECT_EQ(loaded->cfg.arch, p.cfg.arch);
  EXPECT_EQ(loaded->cfg.kv_heads, p.cfg.kv_heads);
  EXPECT_EQ(loaded->cfg.layer_sliding_window, p.cfg.layer_sliding_window);
  EXPECT_TRUE(loaded->cfg.tied_output);
  ASSERT_TRUE(loaded->tok);
  EXPECT_EQ(loaded->tok->vocab_size(), 512);
  const std::vector<int32_t> ids = loaded->tok->encode("Once upon a time, there was a little girl.", true);
  const std::vector<float> h0 = test::hidden_of(m, ids, nullptr), h1 = test::hidden_of(*loaded, ids, nullptr);
  EXPECT_LT(test::max_abs_diff(h0, h1), 1e-5);
}

// GPT-2's own parameters (layer norms with biases, projection biases, learned positions), on the
// tiny random model of test_models.h: every weight is a buffer of m.w.storage, so each pointer of
// the model is matched to its buffer and gets a gradient buffer of the same size.
TEST(FullModelGradGpt2, BiasesLayerNormsAndPositionsMatchFiniteDifferences) {
  auto m = test::random_model(Arch::GPT2, 21);
  std::vector<std::vector<float>> g(m->w.storage.size());
  for (size_t i = 0; i < g.size(); ++i) g[i].assign(m->w.storage[i].size(), 0.f);
  auto grad_of = [&](const void* p) -> float* {
    for (size_t i = 0; i < g.size(); ++i)
      if (m->w.storage[i].data() == p) return g[i].data();
    ADD_FAILURE() << "a weight outside the model's storage";
    return nullptr;
  };
  ModelGrads mg;
  mg.tok_emb = mg.lm_head = grad_of(m->w.tok_emb.data);
  mg.pos_emb = grad_of(m->w.pos_emb);
  mg.out_norm = grad_of(m->w.out_norm);
  mg.out_norm_b = grad_of(m->w.out_norm_b);
  for (const LayerWeights& L : m->w.layers) {
    LayerGrads G;
    G.attn_norm = grad_of(L.attn_norm);
    G.attn_norm_b = grad_of(L.attn_norm_b);
    G.wq = grad_of(L.wq.data);
    G.wk = grad_of(L.wk.data);
    G.wv = grad_of(L.wv.data);
    G.wo = grad_of(L.wo.data);
    G.bq = grad_of(L.bq);
    G.bk = grad_of(L.bk);
    G.bv = grad_of(L.bv);
    G.bo = grad_of(L.bo);
    G.ffn_norm = grad_of(L.ffn_norm);
    G.ffn_norm_b = grad_of(L.ffn_norm_b);
    G.w_up = grad_of(L.w_up.data);
    G.b_up = grad_of(L.b_up);
    G.w_down = grad_of(L.w_down.data);
    G.b_down = grad_of(L.b_down);
    mg.layers.push_back(G);
  }
  const int64_t T = 11;
  const test::Win win = test::window_of(T, m->cfg.vocab, 5);
  const TrainWindow w{win.ids.data(), T, win.targets.data()};
  TrainableSet ts;
  ts.model_grads = &mg;
  train_loss_and_grad(*m, ts, w, 1.f / (T - 2));
  for (size_t k = 0; k < g.size(); ++k) {
    double gn = 0;
    for (float x : g[k]) gn += (double)x * x;
    gn = std::sqrt(gn);
    std::vector<float>& buf = m->w.storage[k];
    const std::vector<float> orig = buf;
    if (gn < 1e-5) {
      // Only the key bias: it adds q.b_k to every score of a query, which the softmax ignores.
      // Its gradient is zero because the loss does not depend on it.
      const double l0 = train_loss(*m, TrainableSet{}, w);
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = orig[i] + 0.1f * (float)((i % 3) + 1);
      EXPECT_NEAR(train_loss(*m, TrainableSet{}, w), l0, 1e-4) << "buffer " << k << ": zero gradient, yet it matters";
      buf = orig;
      EXPECT_TRUE(std::any_of(m->w.layers.begin(), m->w.layers.end(),
                              [&](const LayerWeights& L) { return L.bk == buf.data(); }))
          << "buffer " << k << ": no gradient reached it";
      continue;
    }
    auto along = [&](double t) {
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = orig[i] + (float)(t * g[k][i] / gn);
      const double l = train_loss(*m, TrainableSet{}, w) / (T - 2);
      buf = orig;
      return l;
    };
    EXPECT_NEAR(derivative(along), gn, 3e-3 * gn + 3e-4) << "buffer " << k << " of " << g.size();
  }
}

// Zero degradation on every architecture: routers of any kind leave a context that fits in the
// local window exactly as dense attention computes it; with one group, hard Focus is dense
// attention beyond the window too (up to the kernels' rounding).
TEST_P(FullModelGrad, FocusInsideTheWindowIsDenseAttention) {
  const ModelParams p = tiny_params(GetParam(), 8);
  Model m;
  bind_model(p, m);
  const test::Win win = test::window_of(24, p.cfg.vocab, 3);
  const std::vector<float> dense = test::hidden_of(m, win.ids, nullptr);
  for (FocusMode mode : {FocusMode::Soft, FocusMode::Hard}) {
    FocusSettings s;
    s.mode = mode;
    s.local_window = 24;
    s.groups = 4;
    s.dg = 4;
    const FocusRouters f = focus_init(p.cfg, s, 5);
    ASSERT_FALSE(f.routers.empty());
    const AttentionPlan plan = focus_plan(p.cfg, f);
    const std::vector<float> h = test::hidden_of(m, win.ids, &plan);
    EXPECT_TRUE(h == dense) << to_string(mode) << ": a context inside the window changed";
  }
  FocusSettings one;
  one.mode = FocusMode::Hard;
  one.local_window = 4;
  one.groups = 1;
  one.dg = 4;
  const FocusRouters f = focus_init(p.cfg, one, 5);
  const AttentionPlan plan = focus_plan(p.cfg, f);
  EXPECT_LT(test::max_abs_diff(test::hidden_of(m, win.ids, &plan), dense), 1e-4) << "one group";
}

INSTANTIATE_TEST_SUITE_P(Archs, FullModelGrad, ::testing::Values("mha", "gqa", "mqa", "local-global", "mla"),
                         [](const auto& info) {
                           std::string n = info.param;
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

}  // namespace
}  // namespace focus
