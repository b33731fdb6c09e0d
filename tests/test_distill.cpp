// Asymmetric routing (keys in one group, queries read their top-k) and its training by
// distillation (train/distill.h): gradients against finite differences, the hard policy against
// dense attention and against itself token by token, causality, and the router folder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "focus/block_budget.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "io/safetensors_writer.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"
#include "eval/perplexity.h"
#include "train/backward.h"
#include "train/distill.h"

using namespace focus;
using focus::test::hidden_of;
using focus::test::max_abs_diff;
using focus::test::random_model;
using focus::test::window_of;
using focus::test::asym_settings;

namespace {


// Distillation losses of one window, for finite differences: query cross-entropy and key purity.
DistillStats distill_stats(const Model& m, const FocusRouters& f, const test::Win& w, const DistillOptions& o,
                           std::vector<std::vector<float>>* grads) {
  DistillStats st;
  const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
  distill_loss_and_grad(m, f, tw, 1.0f, o, grads, &st);
  return st;
}

// Gradient of one block of every router (the others zeroed) checked along its direction.
void check_block(const Model& m, FocusRouters f, const test::Win& w, const DistillOptions& o, bool key_side) {
  std::vector<std::vector<float>> g;
  for (auto& r : f.routers) g.emplace_back(r.params.size(), 0.f);
  distill_stats(m, f, w, o, &g);
  for (size_t r = 0; r < g.size(); ++r) {
    const RouterParams& rp = f.routers[r];
    const int64_t lo = key_side ? rp.w_k_offset() : rp.w_r_offset();
    const int64_t hi = lo + rp.cfg.d_g * rp.cfg.dim;
    for (int64_t i = 0; i < (int64_t)g[r].size(); ++i)
      if (i < lo || i >= hi) g[r][i] = 0.f;
  }
  test::expect_directional_derivative(g, [&](double step) {
    FocusRouters p = f;
    for (size_t r = 0; r < g.size(); ++r)
      for (size_t i = 0; i < g[r].size(); ++i) p.routers[r].params[i] += (float)(step * g[r][i]);
    const DistillStats st = distill_stats(m, p, w, o, nullptr);
    return key_side ? -o.key_weight * st.key_purity : st.query_ce;
  });
}

// Weighted hard patterns (group weights, far-pair terms): the training loss of the window is the
// loss inference scores (nll over `scored` targets), a prefix scores as it does inside the longer
// window (causal), and decoding from a cache is refused with an error containing `refusal` (empty:
// decoding gives the window's hidden states).
void expect_trains_as_it_infers(const Model& m, const FocusRouters& f, const test::Win& w, double nll, int64_t scored,
                                const std::string& refusal) {
  const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
  std::vector<std::vector<float>> g;
  for (auto& r : f.routers) g.emplace_back(r.params.size(), 0.f);
  const LossGrad lg = focus_router_loss_and_grad(m, f, tw, 1.0f, &g);
  EXPECT_EQ(lg.scored, scored);
  EXPECT_NEAR(lg.loss_sum, nll, 2e-4 * std::fabs(nll));
  const AttentionPlan plan = focus_plan(m.cfg, f);
  const std::vector<int32_t> prefix(w.ids.begin(), w.ids.begin() + 30);
  EXPECT_LT(max_abs_diff(hidden_of(m, prefix, &plan), hidden_of(m, w.ids, &plan), 0, 30 * m.cfg.dim), 1e-5);
  if (refusal.empty()) {
    EXPECT_LT(max_abs_diff(test::hidden_decoded(m, w.ids, &plan, 30, 20), hidden_of(m, w.ids, &plan)), 1e-5);
    return;
  }
  const std::string e = focus::test::error_of([&] { test::hidden_decoded(m, w.ids, &plan, 30, 20); });
  EXPECT_NE(e.find(refusal), std::string::npos) << e;
}

// Central differences of the hard-pattern training loss (scaled by `scale`) along its gradient,
// restricted to each parameter range [lo, hi) of router `r0` of fa, at two step sizes. Returns
// false, checking nothing, when the loss jumps between the points (a key changes group, or the
// slopes at the two step sizes differ: a query changed the groups it reads); otherwise expects
// each slope to match the gradient's squared norm.
bool fd_matches_gradient(const Model& m, const FocusRouters& fa, const test::Win& w, float scale, size_t r0,
                         const std::vector<std::pair<int64_t, int64_t>>& ranges, const std::string& what) {
  const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
  std::vector<std::vector<float>> ga;
  for (auto& r : fa.routers) ga.emplace_back(r.params.size(), 0.f);
  focus_router_loss_and_grad(m, fa, tw, scale, &ga);
  std::vector<std::pair<double, double>> fd_vs_grad;
  for (auto [lo, hi] : ranges) {
    std::vector<std::vector<float>> dir = ga;
    double g2 = 0;
    for (size_t r = 0; r < dir.size(); ++r)
      for (int64_t i = 0; i < (int64_t)dir[r].size(); ++i) {
        if (r != r0 || i < lo || i >= hi) dir[r][i] = 0.f;
        g2 += (double)dir[r][i] * dir[r][i];
      }
    EXPECT_GT(g2, 1e-10) << what << ": params " << lo << " .. " << hi << " have no gradient";
    if (g2 <= 1e-10) return true;
    double slope[2];
    for (int half = 0; half < 2; ++half) {
      const double h = (half ? 0.5e-3 : 1e-3) / std::sqrt(g2);
      std::vector<std::vector<int32_t>> groups_at[2];
      double loss_at[2];
      for (int side = 0; side < 2; ++side) {
        FocusRouters p = fa;
        for (size_t r = 0; r < dir.size(); ++r)
          for (size_t i = 0; i < dir[r].size(); ++i) p.routers[r].params[i] += (float)((side ? h : -h) * dir[r][i]);
        loss_at[side] = focus_router_loss(m, p, tw) * scale;
        const AttentionPlan plan = focus_plan(m.cfg, p);
        AttentionStats gs;
        gs.groups = &groups_at[side];
        hidden_of(m, w.ids, &plan, &gs);
      }
      if (groups_at[0] != groups_at[1]) return false;
      slope[half] = (loss_at[1] - loss_at[0]) / (2 * h);
    }
    if (std::fabs(slope[0] - slope[1]) > 2e-3 * g2 + 1e-7) return false;
    fd_vs_grad.push_back({slope[1], g2});
  }
  for (size_t c = 0; c < fd_vs_grad.size(); ++c) {
    const auto [fd, g2] = fd_vs_grad[c];
    EXPECT_NEAR(fd, g2, 1e-2 * g2 + 1e-6) << what << ", parameters " << ranges[c].first << " .. " << ranges[c].second;
  }
  return true;
}

}  // namespace

// W_r learns the cross-entropy to the attention mass (M does not depend on W_r); W_k learns the
// purity of the mass through the transpose of the mass kernel (no balance term here: its Sinkhorn
// targets are held fixed, which a finite difference would not do).
TEST(Distill, RouterGradientsMatchFiniteDifferences) {
  for (Arch arch : {Arch::Llama, Arch::GPT2}) {
    // per layer; per kv head; per kv head on q and k; per query head; per query head on q and k
    for (int variant = 0; variant < 5; ++variant) {
      const bool per_kv_head = variant == 1 || variant == 2, per_head = variant >= 3;
      auto m = random_model(arch, 11);
      FocusSettings st = asym_settings(4, 2, 5);
      st.per_kv_head = per_kv_head;
      st.per_head = per_head;
      st.route_on_qk = variant == 2 || variant == 4;
      const FocusRouters f = focus_init(m->cfg, st, 3);
      EXPECT_EQ((int64_t)f.routers.size(),
                m->cfg.layers * (per_head ? m->cfg.heads : per_kv_head ? m->cfg.kv_heads : 1));
      const test::Win w = window_of(40, m->cfg.vocab, 5);
      DistillOptions o;
      o.balance_weight = 0.f;
      o.key_weight = 1.f;
      check_block(*m, f, w, o, /*key_side=*/false);
      check_block(*m, f, w, o, /*key_side=*/true);
    }
  }
}

// The far mass distillation measures is a share of attention (positive, below one) per router,
// the top-k groups read at most all of it, and symmetric routers are refused.
TEST(Distill, MeasuresFarMassAndNeedsAsymmetricRouters) {
  auto m = random_model(Arch::Llama, 12);
  const FocusRouters f = focus_init(m->cfg, asym_settings(4, 1, 5), 4);
  const test::Win w = window_of(48, m->cfg.vocab, 6);
  DistillStats st;
  std::vector<std::vector<float>> g;
  for (auto& r : f.routers) g.emplace_back(r.params.size(), 0.f);
  const TrainWindow tw{w.ids.data(), 48, w.targets.data()};
  const LossGrad lg = distill_loss_and_grad(*m, f, tw, 1.0f, DistillOptions{}, &g, &st);
  EXPECT_GT(lg.scored, 0);
  EXPECT_TRUE(std::isfinite(lg.loss_sum));
  const std::vector<float> far = st.far_mass();
  ASSERT_EQ(far.size(), f.routers.size());
  for (float x : far) {
    EXPECT_GT(x, 0.f);
    EXPECT_LT(x, 1.f);
  }
  EXPECT_GE(st.captured, 0.0);
  EXPECT_LE(st.captured, st.far_total * (1 + 1e-5));
  FocusRouters sym = f;
  sym.settings.asymmetric = false;
  EXPECT_THROW(distill_loss_and_grad(*m, sym, tw, 1.0f, DistillOptions{}, nullptr, nullptr), Error);
}

// Residual distillation: the far mass left as the target is what block top-k with the budgets
// leaves unread, head by head, which the block budget calibration measures on its own (its
// curves at each head's budget); budgets that read every block leave nothing to learn.
TEST(Distill, ResidualTargetIsWhatTheBudgetedBlocksMiss) {
  auto m = random_model(Arch::Llama, 13);
  const ModelConfig& c = m->cfg;
  const int64_t n = 70, B = 4, w = 5, S = 1, KM = 20;
  // The calibration runs windows of n positions with BOS first when the model has one.
  const int32_t bos = m->tok ? m->tok->bos() : -1;
  std::vector<int32_t> ids = window_of(n, c.vocab, 8).ids;
  std::vector<int32_t> cal_ids = ids;
  if (bos >= 0) {
    cal_ids.pop_back();
    ids.insert(ids.begin(), bos);
    ids.pop_back();
  }
  const BlockMassCurves cv = measure_block_mass(*m, cal_ids, n, B, w, S, KM, false);
  auto budget = std::make_shared<BlockBudget>();
  budget->block = B;
  budget->window = w;
  budget->sinks = S;
  budget->ctx = n;
  budget->k.assign(c.layers, {});
  for (int64_t l = 0; l < c.layers; ++l)
    for (int64_t h = 0; h < c.heads; ++h) budget->k[l].push_back((l + 2 * h) % 4);
  const std::vector<int32_t> targets(n, 1);
  const TrainWindow tw{ids.data(), n, targets.data()};
  for (int variant = 0; variant < 3; ++variant) {  // a router per layer, per kv head, per query head
    SCOPED_TRACE(::testing::Message() << "routing variant " << variant);
    FocusSettings s = asym_settings(4, 1, w);
    s.per_kv_head = variant == 1;
    s.per_head = variant == 2;
    const FocusRouters f = focus_init(c, s, 5);
    DistillOptions o;
    o.residual = budget;
    DistillStats st, plain;
    distill_loss_and_grad(*m, f, tw, 1.0f, o, nullptr, &st);
    distill_loss_and_grad(*m, f, tw, 1.0f, DistillOptions{}, nullptr, &plain);
    for (int64_t l = 0; l < c.layers; ++l) {
      const int64_t rpl = f.routers_per_layer, hpr = c.heads / rpl;
      for (int64_t r = 0; r < rpl; ++r) {
        double missed = 0, far = 0;
        for (int64_t h = r * hpr; h < (r + 1) * hpr; ++h) {
          missed += cv.missed_at(l, h, budget->k[l][h]) / hpr;
          far += cv.far[l * c.heads + h] / hpr;
        }
        const int64_t router = f.router_of_layer[l] + r;
        EXPECT_NEAR(st.far_sum[router], missed, 1e-4 * far) << "layer " << l << " router " << r;
        EXPECT_NEAR(plain.far_sum[router], far, 1e-4 * far) << "layer " << l << " router " << r;
        EXPECT_LT(st.far_sum[router], 0.9 * plain.far_sum[router]);
      }
    }
    // Budgets beyond every candidate: nothing far is left unread.
    auto all = std::make_shared<BlockBudget>(*budget);
    for (auto& kl : all->k) std::fill(kl.begin(), kl.end(), int64_t{1000});
    o.residual = all;
    DistillStats none;
    const LossGrad lg = distill_loss_and_grad(*m, f, tw, 1.0f, o, nullptr, &none);
    EXPECT_EQ(lg.scored, 0);
    EXPECT_EQ(none.rows, 0);
    // Budgets measured with another window are refused.
    auto other = std::make_shared<BlockBudget>(*budget);
    other->window = w + 1;
    o.residual = other;
    EXPECT_THROW(distill_loss_and_grad(*m, f, tw, 1.0f, o, nullptr, nullptr), Error);
    // And so are budgets missing a head of a layer.
    auto fewer = std::make_shared<BlockBudget>(*budget);
    fewer->k[0].pop_back();
    o.residual = fewer;
    EXPECT_THROW(distill_loss_and_grad(*m, f, tw, 1.0f, o, nullptr, nullptr), Error);
  }
}

// Queries that read every group see every key: the asymmetric hard policy equals dense attention.
TEST(AsymmetricRouting, ReadingEveryGroupIsDense) {
  auto m = random_model(Arch::Llama, 13);
  FocusSettings s = asym_settings(4, 4, 3);
  s.per_kv_head = true;
  const FocusRouters f = focus_init(m->cfg, s, 5);
  const std::vector<int32_t> ids = window_of(60, m->cfg.vocab, 7).ids;
  const AttentionPlan plan = focus_plan(m->cfg, f);
  AttentionStats st;
  const auto a = hidden_of(*m, ids, &plan, &st);
  const auto d = hidden_of(*m, ids, nullptr);
  EXPECT_LT(max_abs_diff(a, d), 1e-4);
  EXPECT_NEAR(st.density(), 1.0, 1e-12);
}

// Top-1 of 4 groups: sparse (density well below one), the same outputs token by token from the
// cache (with a rollback in between) as in one call, and causal: tokens appended later change
// no earlier output. The key groups keep within key_capacity of the mean load.
TEST(AsymmetricRouting, SparseDecodesLikePrefillAndIsCausal) {
  for (int variant = 0; variant < 5; ++variant) {
    const bool per_kv_head = variant == 1 || variant == 2, per_head = variant >= 3;
    const char* names[] = {"per layer", "per kv head", "per kv head, on q and k", "per query head",
                           "per query head, on q and k"};
    SCOPED_TRACE(names[variant]);
    auto m = random_model(Arch::Llama, 14);
    ASSERT_GT(m->cfg.heads, m->cfg.kv_heads);  // per query head: two routers share each kv head
    FocusSettings s = asym_settings(4, 1, 3);
    s.key_capacity = 1.25f;
    s.per_kv_head = per_kv_head;
    s.per_head = per_head;
    s.route_on_qk = variant == 2 || variant == 4;
    const FocusRouters f = focus_init(m->cfg, s, 6);
    const int64_t n = 60, D = m->cfg.dim;
    const std::vector<int32_t> ids = window_of(n, m->cfg.vocab, 8).ids;
    const AttentionPlan plan = focus_plan(m->cfg, f);
    AttentionStats st;
    std::vector<std::vector<int32_t>> groups;
    st.groups = &groups;
    const auto full = hidden_of(*m, ids, &plan, &st);
    EXPECT_LT(st.density(), 0.75);
    EXPECT_GT(max_abs_diff(full, hidden_of(*m, ids, nullptr)), 1e-3);  // the pattern really is sparse
    for (int64_t l = 0; l < m->cfg.layers; ++l) {
      ASSERT_EQ((int64_t)groups[l].size(), n);
      std::vector<int64_t> load(4, 0);
      for (int64_t j = s.sinks; j < n; ++j) {
        const int64_t cap = (int64_t)std::ceil(s.key_capacity * (double)(j - s.sinks + 1) / 4.0);
        EXPECT_LT(load[groups[l][j]], std::max<int64_t>(1, cap)) << "layer " << l << " key " << j;
        load[groups[l][j]]++;
      }
    }

    EXPECT_LT(max_abs_diff(test::hidden_decoded(*m, ids, &plan, 30, 20), full), 1e-5);

    const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 40);
    EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &plan), full, 0, 40 * D), 1e-5);
  }
}

// The hybrid pattern (groups plus positional blocks by the Quest bound): its pairs are those of
// the groups and of block top-k together (density between the larger and their sum), it decodes
// token by token (with a rollback into the middle of a block) as in one call, it is causal, every
// block read makes it dense attention, and focus.json keeps its blocks.
TEST(AsymmetricRouting, HybridBlocksDecodeLikePrefillAndAreCausal) {
  auto m = random_model(Arch::Llama, 16);
  const int64_t n = 60, D = m->cfg.dim;
  const std::vector<int32_t> ids = window_of(n, m->cfg.vocab, 11).ids;
  FocusSettings s = asym_settings(4, 1, 3);
  s.per_kv_head = true;
  const FocusRouters groups_only = focus_init(m->cfg, s, 8);
  FocusRouters f = groups_only;
  f.settings.blocks = 2;
  f.settings.block_size = 4;
  auto density = [&](const FocusRouters* r, const char* spec, std::vector<float>* h) {
    const AttentionPlan plan = r ? focus_plan(m->cfg, *r) : make_attention_plan(m->cfg, spec);
    AttentionStats st;
    const auto out = hidden_of(*m, ids, &plan, &st);
    if (h) *h = out;
    return st.density();
  };
  std::vector<float> full;
  const double dh = density(&f, nullptr, &full), dg = density(&groups_only, nullptr, nullptr);
  const double db = density(nullptr, "blocktopk:block=4,k=2,window=3,sinks=1", nullptr);
  EXPECT_GT(dh, std::max(dg, db) + 1e-3);
  EXPECT_LT(dh, dg + db);
  EXPECT_LT(dh, 0.9);
  EXPECT_EQ(focus_plan(m->cfg, f).at(0).name(), "focus-hybrid");

  const AttentionPlan plan = focus_plan(m->cfg, f);
  EXPECT_LT(max_abs_diff(test::hidden_decoded(*m, ids, &plan, 30, 22), full), 1e-5);
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 41);
  EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &plan), full, 0, 41 * D), 1e-5);
  // A 16-bit cache: decoding reads the cached elements (block bounds included) as one call over
  // the same cache does. The two sum in different orders (one call reads the block keys in tiles
  // of rows), and a last-bit difference that moves a key or value across a rounding boundary of
  // the cache becomes a difference of half an f16 step in later layers: so the test is that
  // decoding lands far closer to the one call over the cache than the cache's rounding moves
  // anything (decoding that read the unrounded keys would land near the float32 result).
  const auto one16 = test::hidden_decoded(*m, ids, &plan, n, n, cpu::KvType::F16);
  const double rounding = max_abs_diff(one16, full);
  EXPECT_GT(rounding, 1e-4);  // the cache's rounding reached the outputs
  EXPECT_LT(max_abs_diff(test::hidden_decoded(*m, ids, &plan, 30, 22, cpu::KvType::F16), one16), 0.25 * rounding);

  // The blocks chosen once every R rows (3: tiles inside a block, 8: across blocks): another
  // pattern, which decodes as one call computes it (the rollback lands inside a tile, whose first
  // row's choice the cache kept) and is causal.
  for (int64_t R : {3, 8}) {
    SCOPED_TRACE("blocks chosen every " + std::to_string(R) + " rows");
    FocusRouters fr = f;
    fr.settings.block_select_every = R;
    const AttentionPlan pr = focus_plan(m->cfg, fr);
    std::vector<float> fullr;
    EXPECT_LT(density(&fr, nullptr, &fullr), 0.9);
    EXPECT_GT(max_abs_diff(fullr, full), 1e-4);
    EXPECT_LT(max_abs_diff(test::hidden_decoded(*m, ids, &pr, 30, 22), fullr), 1e-5);
    EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &pr), fullr, 0, 41 * D), 1e-5);
  }

  FocusRouters all = f;
  all.settings.blocks = 100;
  std::vector<float> dense_out;
  EXPECT_NEAR(density(&all, nullptr, &dense_out), 1.0, 1e-12);
  EXPECT_LT(max_abs_diff(dense_out, hidden_of(*m, ids, nullptr)), 1e-4);

  const std::string dir = (std::filesystem::temp_directory_path() / "focus_test_hybrid_routers").string();
  FocusRouters f3 = f;
  f3.settings.block_select_every = 3;
  save_focus(f3, dir, m->cfg, "random");
  const FocusRouters g = load_focus(dir, m->cfg);
  EXPECT_EQ(g.settings.blocks, 2);
  EXPECT_EQ(g.settings.block_size, 4);
  EXPECT_EQ(g.settings.block_select_every, 3);
  for (const auto& [field, bad_text] : {std::pair<std::string, std::string>{"\"blocks\": 2", "\"blocks\": -3"},
                                        {"\"block_select_every\": 3", "\"block_select_every\": 0"}}) {
    // a bad block count (or tile of rows) in focus.json is refused, naming the file
    save_focus(f3, dir, m->cfg, "random");
    std::string text = read_file(dir + "/focus.json");
    const size_t at = text.find(field);
    ASSERT_NE(at, std::string::npos);
    text.replace(at, field.size(), bad_text);
    io::write_file_atomic(dir + "/focus.json", text);
    const std::string e = test::error_of([&] { load_focus(dir, m->cfg); });
    EXPECT_NE(e.find("focus.json"), std::string::npos) << e;
    EXPECT_NE(e.find(field.substr(1, field.find('"', 1) - 1)), std::string::npos) << e;
  }
  FocusSettings bad = s;
  bad.asymmetric = false;
  bad.topk = 1;
  bad.blocks = 2;
  EXPECT_THROW(focus_init(m->cfg, bad, 8), Error);
}

// Per-head block budgets in the hybrid: every head at 2 is the uniform pattern of 2 bit for bit;
// uneven budgets decode as one call computes them, read fewer pairs where heads get fewer blocks,
// and survive focus.json; a budget of the wrong shape is refused naming the file.
// Calibrating the hybrid's budgets (FocusSettings::block_calibration): the forward stays the
// model's own dense attention, every routed layer measures its rows, and what the groups read is
// left out of the far probability the blocks must find.
TEST(AsymmetricRouting, BlockBudgetCalibrationAroundGroups) {
  auto m = random_model(Arch::Llama, 16);
  const ModelConfig& c = m->cfg;
  const int64_t n = 60, B = 4, w = 3, S = 1;
  const std::vector<int32_t> ids = window_of(n, c.vocab, 11).ids;
  FocusSettings s = asym_settings(4, 1, w);
  s.per_kv_head = true;
  FocusRouters f = focus_init(c, s, 8);
  BlockMassCurves around = block_mass_curves(c, B, w, S, 8), alone = around;
  f.settings.block_calibration = &around;
  const AttentionPlan plan = focus_plan(c, f);
  EXPECT_LT(max_abs_diff(hidden_of(*m, ids, &plan), hidden_of(*m, ids, nullptr)), 1e-6);
  int64_t rows = 0;
  for (int64_t p = 0; p < n; ++p) rows += p - w >= S;
  // The same rows measured for blocks alone.
  alone = measure_block_mass(*m, ids, n + 1, B, w, S, 8, false);
  for (int64_t l = 0; l < c.layers; ++l) {
    EXPECT_EQ(around.rows[l], rows) << "layer " << l;
    double far_around = 0, far_alone = 0;
    for (int64_t h = 0; h < c.heads; ++h) {
      far_around += around.far[l * c.heads + h];
      far_alone += alone.far[l * c.heads + h];
    }
    EXPECT_GT(far_around, 0.0);
    EXPECT_LT(far_around, far_alone - 1e-3) << "layer " << l << ": the groups read some far keys";
  }
}

TEST(AsymmetricRouting, HybridBlockBudgetsPerHead) {
  auto m = random_model(Arch::Llama, 16);
  const ModelConfig& c = m->cfg;
  const int64_t n = 60, D = c.dim;
  const std::vector<int32_t> ids = window_of(n, c.vocab, 11).ids;
  FocusSettings s = asym_settings(4, 1, 3);
  s.per_kv_head = true;
  FocusRouters uniform = focus_init(c, s, 8);
  uniform.settings.blocks = 2;
  uniform.settings.block_size = 4;
  auto run = [&](const FocusRouters& f, double* density) {
    const AttentionPlan plan = focus_plan(c, f);
    AttentionStats st;
    const auto out = hidden_of(*m, ids, &plan, &st);
    *density = st.density();
    return out;
  };
  auto budgets = [&](std::function<int64_t(int64_t, int64_t)> k) {
    std::vector<std::vector<int64_t>> b(c.layers);
    for (int64_t l = 0; l < c.layers; ++l)
      for (int64_t h = 0; h < c.heads; ++h) b[l].push_back(k(l, h));
    return b;
  };
  double d_uniform = 0, d_twos = 0, d_uneven = 0;
  const auto out_uniform = run(uniform, &d_uniform);
  FocusRouters twos = uniform;
  set_block_budget(twos, c, budgets([](int64_t, int64_t) { return 2; }), "test");
  EXPECT_EQ(twos.settings.blocks, 2);
  EXPECT_EQ(max_abs_diff(run(twos, &d_twos), out_uniform), 0.0);
  EXPECT_EQ(d_twos, d_uniform);
  FocusRouters uneven = uniform;
  set_block_budget(uneven, c, budgets([](int64_t l, int64_t h) { return (l + h) % 3 == 0 ? 0 : (l + h) % 3 == 1 ? 1 : 5; }),
                   "test");
  EXPECT_EQ(uneven.settings.blocks, 5);
  const auto full = run(uneven, &d_uneven);
  EXPECT_GT(max_abs_diff(full, out_uniform), 1e-4);  // other blocks were read
  FocusRouters fives = uniform;
  fives.settings.blocks = 5;
  double d_fives = 0;
  run(fives, &d_fives);
  EXPECT_LT(d_uneven, d_fives - 1e-3);  // the heads given 0 or 1 read fewer than 5
  // Every budget 0: the hybrid still runs, each head reading the block of its last far key only.
  FocusRouters zeros = uniform;
  double d_zeros = 0, d_groups = 0;
  set_block_budget(zeros, c, budgets([](int64_t, int64_t) { return 0; }), "test");
  EXPECT_EQ(focus_plan(c, zeros).at(0).name(), "focus-hybrid");
  run(zeros, &d_zeros);
  FocusRouters groups_only = uniform;
  groups_only.settings.blocks = 0;
  run(groups_only, &d_groups);
  EXPECT_GT(d_zeros, d_groups + 1e-3);
  EXPECT_LT(d_zeros, d_uniform - 1e-3);
  const AttentionPlan plan = focus_plan(c, uneven);
  EXPECT_EQ(plan.at(0).name(), "focus-hybrid");
  EXPECT_LT(max_abs_diff(test::hidden_decoded(*m, ids, &plan, 30, 22), full), 1e-5);
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 41);
  EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &plan), full, 0, 41 * D), 1e-5);

  const std::string dir = (std::filesystem::temp_directory_path() / "focus_test_budget_routers").string();
  save_focus(uneven, dir, c, "random");
  const FocusRouters g = load_focus(dir, c);
  EXPECT_EQ(g.block_budget, uneven.block_budget);
  EXPECT_EQ(g.settings.blocks, 5);
  double d_loaded = 0;
  EXPECT_EQ(max_abs_diff(run(g, &d_loaded), full), 0.0);
  {  // a budget list of the wrong length in focus.json is refused, naming the file
    std::string text = read_file(dir + "/focus.json");
    const size_t at = text.find("\"block_budget\": [");
    ASSERT_NE(at, std::string::npos);
    const size_t open = text.find('[', text.find('[', at) + 1);
    text.insert(open + 1, "7,");
    io::write_file_atomic(dir + "/focus.json", text);
    const std::string e = test::error_of([&] { load_focus(dir, c); });
    EXPECT_NE(e.find("focus.json"), std::string::npos) << e;
    EXPECT_NE(e.find("block budgets"), std::string::npos) << e;
  }
  std::vector<std::vector<int64_t>> short_list(c.layers - 1, std::vector<int64_t>(c.heads, 1));
  EXPECT_NE(test::error_of([&] { set_block_budget(uneven, c, short_list, "b.json"); }).find("b.json"),
            std::string::npos);
}

// Sparse training (retrofit --objective sparse) runs the pattern inference runs: its loss is the
// hard policy's loss on the same window, per layer and per kv head, at top-1 and top-2. The
// straight-through gradients reach both projections (W_r from the queries' memberships, W_k from
// the keys') and are finite; with a SwAV hook the keys' scores get its gradient too.
TEST(AsymmetricRouting, SparseTrainingSeesTheInferencePattern) {
  for (Arch arch : {Arch::Llama, Arch::GPT2})
    for (int variant = 0; variant < 4; ++variant) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::Llama ? "llama" : "gpt2") << " variant " << variant);
      auto m = random_model(arch, 16);
      FocusSettings s = asym_settings(4, 1 + variant % 2, 3);
      s.per_kv_head = variant >= 2;
      s.key_capacity = 1.25f;
      const FocusRouters f = focus_init(m->cfg, s, 8);
      const test::Win w = window_of(60, m->cfg.vocab, 9);
      const TrainWindow tw{w.ids.data(), (int64_t)w.ids.size(), w.targets.data()};
      std::vector<std::vector<float>> g;
      for (auto& r : f.routers) g.emplace_back(r.params.size(), 0.f);
      const LossGrad lg = focus_router_loss_and_grad(*m, f, tw, 1.0f, &g);
      const AttentionPlan hard = focus_plan(m->cfg, f);
      AttentionStats st;
      int64_t scored = 0;
      const double nll = window_nll(*m, w.ids, w.targets, &hard, &st, &scored);
      EXPECT_EQ(lg.scored, scored);
      EXPECT_LT(st.density(), 0.9);
      EXPECT_NEAR(lg.loss_sum, nll, 2e-4 * std::fabs(nll));
      const double dense = window_nll(*m, w.ids, w.targets, nullptr, nullptr, &scored);
      EXPECT_GT(std::fabs(nll - dense), 1e-3) << "the pattern should change the loss";
      for (size_t r = 0; r < g.size(); ++r) {
        const RouterParams& rp = f.routers[r];
        double wr = 0, wk = 0;
        for (int64_t i = 0; i < rp.cfg.d_g * rp.cfg.dim; ++i) {
          ASSERT_TRUE(std::isfinite(g[r][rp.w_r_offset() + i]) && std::isfinite(g[r][rp.w_k_offset() + i]));
          wr += std::fabs(g[r][rp.w_r_offset() + i]);
          wk += std::fabs(g[r][rp.w_k_offset() + i]);
        }
        EXPECT_GT(wr, 0.0) << "router " << r << " W_r";
        EXPECT_GT(wk, 0.0) << "router " << r << " W_k";
      }
    }
}

// Group weights (retrofit --objective sparse --group-bias): the far pairs of the hard pattern
// carry log(p_query(g) * p_key(g)). Training computes the loss inference computes, per layer and
// per kv head; the weights change it; the same set of pairs is read (the density of the unweighted
// pattern); the routers' gradient, taken through the probabilities of the groups read, matches
// central differences (all groups read, at a point where a small step moves no key to another
// group); causality holds; and decoding from a cache is refused with a clear error.
TEST(AsymmetricRouting, GroupWeightsTrainAsTheyInfer) {
  for (Arch arch : {Arch::Llama, Arch::GPT2})
    for (int variant = 0; variant < 2; ++variant) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::Llama ? "llama" : "gpt2") << (variant ? " per kv head" : " per layer"));
      auto m = random_model(arch, 17);
      FocusSettings s = asym_settings(4, 2, 3);
      s.per_kv_head = variant == 1;
      s.key_capacity = 1.25f;
      FocusRouters f = focus_init(m->cfg, s, 9);
      const test::Win w = window_of(50, m->cfg.vocab, 10);
      int64_t scored = 0;
      AttentionStats plain;
      const AttentionPlan unweighted = focus_plan(m->cfg, f);
      const double nll_plain = window_nll(*m, w.ids, w.targets, &unweighted, &plain, &scored);
      f.settings.group_bias = true;
      const AttentionPlan weighted = focus_plan(m->cfg, f);
      AttentionStats st;
      const double nll = window_nll(*m, w.ids, w.targets, &weighted, &st, &scored);
      EXPECT_LT(st.density(), 0.9);
      EXPECT_GT(std::fabs(nll - nll_plain), 1e-3) << "the weights should change the loss";
      expect_trains_as_it_infers(*m, f, w, nll, scored, "group weights");

      // Central differences on the last layer's routers (no later layer re-routes), along the
      // gradient of W_r (queries), of W_k (keys: those the capacity keeps out of their best group
      // have weights) and of the centroids (both); every group read (top-4 of 4), then half of them
      // (top-2: the groups a query does not read pass no gradient to its probabilities). The first
      // router seed without a jump between the points is the one checked.
      for (int topk : {4, 2}) {
        FocusSettings all = s;
        all.topk = topk;
        all.group_bias = true;
        int checked = 0;
        for (uint64_t seed = 9; seed < 60 && checked == 0; ++seed) {
          const FocusRouters fa = focus_init(m->cfg, all, seed);
          const size_t last = fa.routers.size() - (variant ? m->cfg.kv_heads : 1);
          const RouterParams& r0 = fa.routers[last];
          const int64_t proj = r0.cfg.d_g * r0.cfg.dim;
          checked += fd_matches_gradient(*m, fa, w, 1.f / (float)scored, last,
                                         {{r0.w_r_offset(), r0.w_r_offset() + proj},
                                          {r0.w_k_offset(), r0.w_k_offset() + proj},
                                          {r0.centroids_offset(), r0.centroids_offset() + r0.cfg.groups * r0.cfg.d_g}},
                                         "top-" + std::to_string(topk) + " of 4, router seed " + std::to_string(seed));
        }
        EXPECT_EQ(checked, 1) << "top-" << topk << ": no router seed without a jump";
      }
    }
}

// Far-pair terms (retrofit --objective sparse --far-bias): a far pair read carries e_q(i) + e_k(j),
// each linear in the router's input. At zero (as trained runs start) they change nothing; with
// values they change the loss but not the pairs read. Training scores what inference scores, per
// layer, per kv head, together with group weights and on the hybrid pattern (a pair a positional
// block reads carries the terms too); causality holds; decoding from a cache gives
// the window's result (refused with group weights); the gradient of the terms (and with group weights, of W_r, W_k and the centroids)
// matches central differences; the folder keeps them.
TEST(AsymmetricRouting, FarTermsTrainAsTheyInfer) {
  for (Arch arch : {Arch::Llama, Arch::GPT2})
    for (int variant = 0; variant < 7; ++variant) {
      SCOPED_TRACE(::testing::Message() << (arch == Arch::Llama ? "llama" : "gpt2")
                                        << (variant == 1   ? " per kv head"
                                            : variant == 2 ? " with group weights"
                                            : variant == 3 ? " with blocks (hybrid)"
                                            : variant == 4 ? " with blocks, per kv head"
                                            : variant == 5 ? " with blocks chosen every 4 rows, per kv head"
                                            : variant == 6 ? " with per-head budgets, near blocks and the group switch"
                                                           : " per layer"));
      auto m = random_model(arch, 18);
      FocusSettings s = asym_settings(4, 2, 3);
      s.per_kv_head = variant == 1 || variant >= 4;
      s.group_bias = variant == 2;
      if (variant >= 3) {  // the hybrid: 2 blocks of 3 keys besides the block of the last far key
        s.blocks = 2;
        s.block_size = 3;
      }
      if (variant == 5) s.block_select_every = 4;
      s.key_capacity = 1.25f;
      // Variant 6: each head its own budget and near blocks; heads 1 and 2 read blocks alone.
      auto budgeted = [&](FocusRouters f) {
        if (variant != 6) return f;
        std::vector<std::vector<int64_t>> k(m->cfg.layers), near(m->cfg.layers), group(m->cfg.layers);
        for (int64_t l = 0; l < m->cfg.layers; ++l)
          for (int64_t h = 0; h < m->cfg.heads; ++h) {
            k[l].push_back((l + h) % 3);
            near[l].push_back((l + 2 * h) % 3);
            group[l].push_back(h == 1 || h == 2 ? 0 : 1);
          }
        set_block_budget(f, m->cfg, k, "test", near, group);
        return f;
      };
      const FocusRouters plain = budgeted(focus_init(m->cfg, s, 9));
      s.far_bias = true;
      FocusRouters f = budgeted(focus_init(m->cfg, s, 9));
      const test::Win w = window_of(50, m->cfg.vocab, 11);
      int64_t scored = 0;
      std::vector<std::vector<int32_t>> groups_plain, groups_weighted;
      AttentionStats st_plain, st_zero, st;
      st_plain.groups = &groups_plain;
      st.groups = &groups_weighted;
      const AttentionPlan p_plain = focus_plan(m->cfg, plain);
      const double nll_plain = window_nll(*m, w.ids, w.targets, &p_plain, &st_plain, &scored);
      const AttentionPlan p_zero = focus_plan(m->cfg, f);
      const double nll_zero = window_nll(*m, w.ids, w.targets, &p_zero, &st_zero, &scored);
      EXPECT_NEAR(nll_zero, nll_plain, 1e-5 * std::fabs(nll_plain)) << "zero terms must change nothing";
      EXPECT_EQ(st_zero.density(), st_plain.density());

      for (size_t r = 0; r < f.routers.size(); ++r)
        for (RouterSide side : {RouterSide::Query, RouterSide::Key}) {
          const auto v = test::random_normal(m->cfg.dim + 1, 40 + 2 * r + (side == RouterSide::Key), 2.f / kFarBiasGain);
          std::copy(v.begin(), v.end(), f.routers[r].params.begin() + f.routers[r].far_offset(side));
        }
      const AttentionPlan weighted = focus_plan(m->cfg, f);
      const double nll = window_nll(*m, w.ids, w.targets, &weighted, &st, &scored);
      EXPECT_GT(std::fabs(nll - nll_plain), 1e-3) << "the terms should change the loss";
      if (variant == 6) {  // the switch changes the loss: without it every head reads its groups
        FocusRouters all = f;
        for (auto& l : all.block_group) std::fill(l.begin(), l.end(), 1);
        const AttentionPlan p_all = focus_plan(m->cfg, all);
        AttentionStats st_all;
        const double nll_all = window_nll(*m, w.ids, w.targets, &p_all, &st_all, &scored);
        EXPECT_GT(std::fabs(nll - nll_all), 1e-3) << "the group switch should change the loss";
        EXPECT_GT(st_all.density(), st.density() + 0.01) << "heads without groups should read fewer pairs";
      }
      // The first layer's routing reads the same input: its groups do not move (later layers read
      // the changed hidden state).
      ASSERT_FALSE(groups_plain.empty() || groups_plain[0].empty());
      EXPECT_EQ(groups_weighted[0], groups_plain[0]) << "the terms must not change the pairs read";
      // Without group weights the terms run in the grouped kernels, which decode from a cache.
      expect_trains_as_it_infers(*m, f, w, nll, scored, s.group_bias ? "group weights" : "");

      // Central differences on the last layer's routers, top-2 of 4: the query terms, the key
      // terms and, with group weights, W_r, W_k and the centroids (without them the routers'
      // gradient is the straight-through estimate, which no difference of the loss measures).
      int checked = 0;
      for (uint64_t seed = 9; seed < 60 && checked == 0; ++seed) {
        FocusRouters fa = budgeted(focus_init(m->cfg, s, seed));
        for (size_t r = 0; r < fa.routers.size(); ++r)
          for (RouterSide side : {RouterSide::Query, RouterSide::Key}) {
            const auto v =
                test::random_normal(m->cfg.dim + 1, seed * 100 + 2 * r + (side == RouterSide::Key), 1.f / kFarBiasGain);
            std::copy(v.begin(), v.end(), fa.routers[r].params.begin() + fa.routers[r].far_offset(side));
          }
        const size_t last = fa.routers.size() - (s.per_kv_head ? m->cfg.kv_heads : 1);
        const RouterParams& r0 = fa.routers[last];
        const int64_t proj = r0.cfg.d_g * r0.cfg.dim, fq = r0.far_offset(RouterSide::Query),
                      fk = r0.far_offset(RouterSide::Key);
        std::vector<std::pair<int64_t, int64_t>> ranges = {{fq, fq + r0.cfg.dim + 1}, {fk, fk + r0.cfg.dim + 1}};
        if (s.group_bias)
          ranges.insert(ranges.end(), {{r0.w_r_offset(), r0.w_r_offset() + proj},
                                       {r0.w_k_offset(), r0.w_k_offset() + proj},
                                       {r0.centroids_offset(), r0.centroids_offset() + r0.cfg.groups * r0.cfg.d_g}});
        checked += fd_matches_gradient(*m, fa, w, 1.f / (float)scored, last, ranges,
                                       "router seed " + std::to_string(seed));
      }
      EXPECT_EQ(checked, 1) << "no router seed without a jump";

      // The folder keeps the terms.
      const std::string dir = (std::filesystem::temp_directory_path() / "focus_test_far_terms").string();
      save_focus(f, dir, m->cfg, "random");
      const FocusRouters back = load_focus(dir, m->cfg);
      EXPECT_TRUE(back.settings.far_bias);
      ASSERT_EQ(back.routers.size(), f.routers.size());
      for (size_t r = 0; r < f.routers.size(); ++r) EXPECT_EQ(back.routers[r].params, f.routers[r].params);
    }
}

// Router folders keep the asymmetric routing, W_k, the capacity and the measured far mass; the
// per-layer choice turns low-mass layers into window + sinks.
TEST(AsymmetricRouting, FolderRoundTripAndPerLayerChoice) {
  auto m = random_model(Arch::Llama, 15);
  FocusSettings st = asym_settings(4, 2, 3);
  st.per_kv_head = true;  // 2 routers per layer
  FocusRouters f = focus_init(m->cfg, st, 7);
  ASSERT_EQ(f.routers.size(), 6u);
  f.far_mass = {0.5f, 0.6f, 0.01f, 0.02f, 0.3f, 0.2f};
  f.settings.window_only_below = 0.05f;
  const std::string dir = (std::filesystem::temp_directory_path() / "focus_test_asym_routers").string();
  save_focus(f, dir, m->cfg, "random");
  const FocusRouters g = load_focus(dir, m->cfg);
  EXPECT_TRUE(g.settings.asymmetric);
  EXPECT_EQ(g.settings.topk, 2);
  EXPECT_EQ(g.settings.key_capacity, f.settings.key_capacity);
  EXPECT_EQ(g.far_mass, f.far_mass);
  EXPECT_TRUE(g.settings.per_kv_head);
  EXPECT_EQ(g.routers_per_layer, 2);
  {  // one router per query head: its own tensor names, back with the same count
    FocusSettings sh = asym_settings(4, 2, 3);
    sh.per_head = true;
    const FocusRouters fh = focus_init(m->cfg, sh, 9);
    const std::string dh = dir + "_per_head";
    save_focus(fh, dh, m->cfg, "random");
    const FocusRouters gh = load_focus(dh, m->cfg);
    EXPECT_TRUE(gh.settings.per_head && !gh.settings.per_kv_head);
    EXPECT_EQ(gh.routers_per_layer, m->cfg.heads);
    ASSERT_EQ(gh.routers.size(), fh.routers.size());
    for (size_t r = 0; r < fh.routers.size(); ++r) EXPECT_EQ(gh.routers[r].params, fh.routers[r].params);
    FocusSettings both = sh;
    both.per_kv_head = true;
    EXPECT_THROW(focus_init(m->cfg, both, 9), Error);
  }
  ASSERT_EQ(g.routers.size(), f.routers.size());
  for (size_t r = 0; r < f.routers.size(); ++r) EXPECT_EQ(g.routers[r].params, f.routers[r].params);
  const AttentionPlan plan = focus_plan(m->cfg, g);
  EXPECT_EQ(plan.at(0).name(), "focus-asymmetric");
  EXPECT_EQ(plan.at(1).name(), "window");
  EXPECT_EQ(plan.at(2).name(), "focus-asymmetric");
  FocusRouters d = g;
  d.settings.dense_above = 0.4f;  // layer 0 (far mass 0.5) keeps dense attention
  EXPECT_EQ(focus_plan(m->cfg, d).at(0).name(), "dense");
  EXPECT_EQ(focus_plan(m->cfg, d).at(2).name(), "focus-asymmetric");
  // far_mass of the wrong length is refused, naming the file.
  std::string text = read_file(dir + "/focus.json");
  const size_t at = text.find("\"far_mass\": [");
  ASSERT_NE(at, std::string::npos);
  text.insert(at + 13, "0.1, ");
  io::write_file_atomic(dir + "/focus.json", text);
  try {
    load_focus(dir, m->cfg);
    FAIL() << "a far_mass of 7 entries for 6 routers must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("far_mass"), std::string::npos) << e.what();
  }
}

// Options of a policy spec: read by the factory, and an unknown or malformed one is an error.
TEST(AttentionOptions, SpecsAreParsedStrictly) {
  const AttentionOptions o = AttentionOptions::parse("block=64,k=8", "x:block=64,k=8");
  EXPECT_EQ(o.get_int("block", 0), 64);
  EXPECT_THROW(o.check_all_read("x"), Error);  // k not read yet
  EXPECT_EQ(o.get_int("k", 0), 8);
  EXPECT_NO_THROW(o.check_all_read("x"));
  EXPECT_EQ(o.get_int("absent", 5), 5);
  EXPECT_THROW(AttentionOptions::parse("block", "x:block"), Error);
  EXPECT_THROW(AttentionOptions::parse("a=1,a=2", "x:a=1,a=2"), Error);
  EXPECT_THROW(AttentionOptions::parse("a=x", "x:a=x").get_int("a", 0), Error);
  ModelConfig c;
  c.layers = 1;
  c.layer_sliding_window = {0};
  EXPECT_THROW(make_attention_plan(c, "dense:window=3"), Error);
}
