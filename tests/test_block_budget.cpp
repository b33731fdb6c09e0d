// Per-head block budgets (focus/block_budget.h): the calibration's curves against the block
// top-k selection they describe, the greedy allocation against an exhaustive search, the budget
// file and the policy option that reads it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "io/safetensors_writer.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::random_normal;
using focus::test::softmax_row;

namespace {

ModelConfig small_config() { return focus::test::one_global_layer_config(); }

BlockMassCurves empty_curves(const ModelConfig& c, int64_t block, int64_t window, int64_t sinks, int64_t k_max) {
  return block_mass_curves(c, block, window, sinks, k_max);
}

// The block bounds block top-k keeps for the first n keys of k.
BlockTopKState block_state(const ModelConfig& c, int64_t block, const std::vector<float>& k, int64_t n) {
  BlockTopKState st(block, c.kv_heads, c.head_dim);
  st.append(cpu::KvView(k.data()), c.kv_dim(), n);
  return st;
}

std::string temp_file(const std::string& name) { return ::testing::TempDir() + "/focus_budget_" + name; }

}  // namespace

// missed(K) is, summed over rows, the probability beyond the window and the sinks that block top-k
// with K blocks leaves unread: checked against the policy's own selection (block_topk_select) and a
// float64 softmax, for every K up to k_max, with the rows measured in one call and in two.
TEST(BlockBudget, CurvesMatchTheSelectionTheyDescribe) {
  const ModelConfig c = small_config();
  const int64_t n = 90, KM = 12;
  const auto q = random_normal(n * c.q_dim(), 11, 2.f);  // peaked attention: the ranking matters
  const auto k = random_normal(n * c.kv_dim(), 12, 1.f);
  struct Case {
    int64_t block, window, sinks;
  };
  for (const Case& cs : {Case{4, 5, 1}, Case{8, 3, 0}, Case{5, 10, 7}, Case{1, 2, 2}}) {
    SCOPED_TRACE("block " + std::to_string(cs.block) + " window " + std::to_string(cs.window) + " sinks " +
                 std::to_string(cs.sinks));
    BlockMassCurves one = empty_curves(c, cs.block, cs.window, cs.sinks, KM);
    BlockMassCurves two = one;
    AttentionCall a;
    a.cfg = &c;
    a.k = k.data();
    a.q = q.data();
    a.T = n;
    measure_block_mass_call(a, one);
    for (auto [pos0, T] : {std::pair<int64_t, int64_t>{0, 37}, {37, n - 37}}) {
      a.pos0 = pos0;
      a.T = T;
      a.q = q.data() + pos0 * c.q_dim();
      measure_block_mass_call(a, two);
    }
    int64_t rows = 0;
    for (int64_t p = 0; p < n; ++p) rows += p - cs.window >= cs.sinks;
    EXPECT_EQ(one.rows[0], rows);
    EXPECT_EQ(two.rows[0], rows);

    // The selection block top-k makes with K blocks, on the same keys.
    BlockTopKState st = block_state(c, cs.block, k, n);
    AttentionCall all;
    all.cfg = &c;
    all.q = q.data();
    all.k = k.data();
    all.T = n;
    bool ranks = false;
    for (int64_t K = 0; K <= KM; ++K) {
      BlockTopKSettings s;
      s.block = cs.block;
      s.k = K;
      s.window = cs.window;
      s.sinks = cs.sinks;
      std::vector<int32_t> qg;
      const int kq = block_topk_select(all, st, s, qg);
      for (int64_t h = 0; h < c.heads; ++h) {
        double missed = 0, far = 0;
        for (int64_t p = 0; p < n; ++p) {
          const int64_t f = p - cs.window;
          if (f < cs.sinks) continue;
          const std::vector<double> pr = softmax_row(q, k, c, p, h);
          const int32_t* slots = qg.data() + (p * c.heads + h) * kq;
          for (int64_t j = cs.sinks; j <= f; ++j) {
            far += pr[j];
            if (std::find(slots, slots + kq, (int32_t)(j / cs.block)) == slots + kq) missed += pr[j];
          }
        }
        EXPECT_NEAR(one.missed_at(0, h, K), missed, 1e-4 * (1 + missed)) << "head " << h << " K " << K;
        EXPECT_NEAR(two.missed_at(0, h, K), missed, 1e-4 * (1 + missed)) << "head " << h << " K " << K;
        EXPECT_NEAR(one.far[h], far, 1e-4 * (1 + far));
        if (K > 0) {
          EXPECT_LE(one.missed_at(0, h, K), one.missed_at(0, h, K - 1) + 1e-12);
          ranks |= one.missed_at(0, h, K) < one.missed_at(0, h, K - 1) - 1e-6 && missed > 1e-3;
        }
      }
    }
    EXPECT_TRUE(ranks) << "some head gains from a block while still missing mass";
  }
}

// The greedy allocation reaches the exhaustive optimum on convex curves, spends exactly the
// budget, keeps every K within k_max and leaves unmeasured layers empty.
TEST(BlockBudget, GreedyAllocationIsOptimalOnConvexCurves) {
  ModelConfig c = small_config();
  c.layers = 3;
  c.heads = 3;
  c.layer_sliding_window = {0, 0, 0};
  const int64_t KM = 5;
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    BlockMassCurves cv = empty_curves(c, 8, 64, 1, KM);
    cv.rows = {10, 0, 10};  // layer 1 not measured
    const auto r = random_normal(c.layers * c.heads * KM, seed, 1.f);
    for (int64_t l = 0; l < c.layers; ++l)
      for (int64_t h = 0; h < c.heads; ++h) {
        std::vector<double> gains(KM);  // decreasing gains: a convex, decreasing curve
        for (int64_t i = 0; i < KM; ++i) gains[i] = std::fabs(r[(l * c.heads + h) * KM + i]);
        std::sort(gains.rbegin(), gains.rend());
        double m = 0;
        for (double g : gains) m += g;
        for (int64_t K = 0; K <= KM; ++K) {
          cv.missed[(l * c.heads + h) * (KM + 1) + K] = m;
          if (K < KM) m -= gains[K];
        }
      }
    for (double mean_k : {0.0, 1.0, 2.5, 3.0, 5.0, 9.0}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " mean k " + std::to_string(mean_k));
      const auto k = allocate_block_budget(cv, mean_k);
      ASSERT_EQ((int64_t)k.size(), c.layers);
      EXPECT_TRUE(k[1].empty());
      int64_t sum = 0;
      double cost = 0;
      std::vector<std::pair<int64_t, int64_t>> heads;
      for (int64_t l : {0, 2})
        for (int64_t h = 0; h < c.heads; ++h) {
          ASSERT_EQ((int64_t)k[l].size(), c.heads);
          EXPECT_GE(k[l][h], 0);
          EXPECT_LE(k[l][h], KM);
          sum += k[l][h];
          cost += cv.missed_at(l, h, k[l][h]);
          heads.push_back({l, h});
        }
      const int64_t total = std::min<int64_t>((int64_t)std::floor(mean_k * 6), 6 * KM);
      EXPECT_EQ(sum, total);
      // Every split of total over the 6 heads.
      double best = INFINITY;
      std::vector<int64_t> at(heads.size(), 0);
      std::function<void(size_t, int64_t, double)> walk = [&](size_t i, int64_t left, double acc) {
        if (i == heads.size()) {
          if (left == 0) best = std::min(best, acc);
          return;
        }
        for (int64_t K = 0; K <= std::min(KM, left); ++K)
          walk(i + 1, left - K, acc + cv.missed_at(heads[i].first, heads[i].second, K));
      };
      walk(0, total, 0.0);
      EXPECT_NEAR(cost, best, 1e-9);
    }
  }
}

// The file round-trips; `blocktopk:budget=FILE` gives each head its K and takes block, window and
// sinks from the file; contradictions and bad files are errors naming the problem.
TEST(BlockBudget, FileAndPolicyOption) {
  const ModelConfig c = small_config();
  BlockBudget b;
  b.block = 4;
  b.window = 5;
  b.sinks = 1;
  b.ctx = 90;
  b.mean_k = 1.5;
  b.k = {{0, 3, 1, 2}};
  const std::string path = temp_file("ok.json");
  save_block_budget(path, b);
  const BlockBudget r = load_block_budget(path);
  EXPECT_EQ(r.block, 4);
  EXPECT_EQ(r.window, 5);
  EXPECT_EQ(r.sinks, 1);
  EXPECT_EQ(r.ctx, 90);
  EXPECT_EQ(r.k, b.k);
  const BlockTopKSettings s = block_topk_settings(AttentionOptions::parse("budget=" + path, "blocktopk"), c, 0);
  EXPECT_EQ(s.block, 4);
  EXPECT_EQ(s.window, 5);
  EXPECT_EQ(s.sinks, 1);
  EXPECT_EQ(s.k, 3);
  EXPECT_EQ(s.head_k, b.k[0]);
  EXPECT_EQ(make_attention_plan(c, "blocktopk:budget=" + path + ",window=5").at(0).name(), "blocktopk");
  auto err = [&](const std::string& spec) {
    return focus::test::error_of([&] { make_attention_plan(c, spec); });
  };
  EXPECT_NE(err("blocktopk:budget=" + path + ",k=3").find("not both"), std::string::npos);
  EXPECT_NE(err("blocktopk:budget=" + path + ",window=6").find("differs"), std::string::npos);
  b.k = {{1, 2, 3}};
  const std::string three = temp_file("three.json");
  save_block_budget(three, b);
  EXPECT_NE(err("blocktopk:budget=" + three).find("3 head budgets"), std::string::npos);
  b.k = {{1, 2, 3, 4}, {1, 2, 3, 4}};
  const std::string two = temp_file("two.json");
  save_block_budget(two, b);
  EXPECT_NE(err("blocktopk:budget=" + two).find("2 layers"), std::string::npos);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{", "invalid JSON"},
      {"{\"format\": \"focus-router\"}", "not a block budget file"},
      {"{\"format\": \"focus-block-budget\", \"block\": 4, \"window\": 5, \"sinks\": 1}", "missing field 'k'"},
      {"{\"format\": \"focus-block-budget\", \"block\": 4, \"window\": 5, \"sinks\": 1, \"k\": [[1, -2, 0, 0]]}",
       "out of range"},
      {"{\"format\": \"focus-block-budget\", \"block\": 0, \"window\": 5, \"sinks\": 1, \"k\": [[1, 2, 0, 0]]}",
       "'block' out of range"},
      {"{\"format\": \"focus-block-budget\", \"block\": 4, \"window\": 5, \"sinks\": 1, \"k\": [1, 2]}",
       "per-layer lists"},
      {"{\"format\": \"focus-block-budget\", \"block\": 4.5, \"window\": 5, \"sinks\": 1, \"k\": [[1, 2, 0, 0]]}",
       "must be an integer"}};
  const std::string badp = temp_file("bad.json");
  for (const auto& [text, word] : bad) {
    std::ofstream(badp) << text;
    const std::string e = err("blocktopk:budget=" + badp);
    EXPECT_NE(e.find(badp), std::string::npos) << e;
    EXPECT_NE(e.find(word), std::string::npos) << e;
  }
  EXPECT_NE(err("blocktopk:budget=" + temp_file("absent.json")).find("absent.json"), std::string::npos);
}

// Curves written by `focus budget --curves` load back to the same budgets; other files are refused.
TEST(BlockBudget, CurvesFileRoundTrip) {
  ModelConfig c = small_config();
  c.layers = 2;
  c.layer_sliding_window = {0, 0};
  BlockMassCurves cv = empty_curves(c, 8, 64, 1, 6);
  cv.rows = {37, 0};
  const auto r = random_normal(cv.missed.size(), 5, 1.f);
  for (int64_t h = 0; h < c.heads; ++h) {
    double m = 0;
    for (int64_t k = 6; k >= 0; --k) {
      m += std::fabs(r[h * 7 + k]);
      cv.missed[h * 7 + k] = m;
    }
    cv.far[h] = m + 1;
  }
  const std::string path = temp_file("curves.safetensors");
  save_block_curves(path, cv, 8192);
  int64_t ctx = 0;
  EXPECT_TRUE(load_block_curves(path, &ctx).group_keys.empty());
  cv.group_keys.assign(c.layers * c.heads, 0.0);  // measured around groups: their keys travel too
  for (int64_t h = 0; h < c.heads; ++h) cv.group_keys[h] = 37.0 * (10 + h);
  save_block_curves(path, cv, 8192);
  const BlockMassCurves back = load_block_curves(path, &ctx);
  ASSERT_EQ(back.group_keys.size(), cv.group_keys.size());
  for (size_t i = 0; i < cv.group_keys.size(); ++i) EXPECT_NEAR(back.group_keys[i], cv.group_keys[i], 1e-3);
  EXPECT_EQ(ctx, 8192);
  EXPECT_EQ(back.block, 8);
  EXPECT_EQ(back.window, 64);
  EXPECT_EQ(back.sinks, 1);
  EXPECT_EQ(back.k_max, 6);
  EXPECT_EQ(back.rows, cv.rows);
  for (size_t i = 0; i < cv.missed.size(); ++i) EXPECT_NEAR(back.missed[i], cv.missed[i], 1e-6 * (1 + cv.missed[i]));
  for (double mean_k : {1.0, 2.5, 4.0}) EXPECT_EQ(allocate_block_budget(back, mean_k), allocate_block_budget(cv, mean_k));
  BlockBudget b;
  b.k = {{1, 2, 3, 4}};
  const std::string other = temp_file("not_curves.json");
  save_block_budget(other, b);
  EXPECT_NE(focus::test::error_of([&] { load_block_curves(other, nullptr); }).find(other), std::string::npos);
  // Curves files with bad metadata or shapes: errors naming the file and the problem.
  const std::string bad = temp_file("bad_curves.safetensors");
  auto write = [&](std::map<std::string, io::F32Tensor> t, std::map<std::string, std::string> md) {
    io::save_safetensors(bad, t, md);
    return focus::test::error_of([&] { load_block_curves(bad, nullptr); });
  };
  const std::map<std::string, std::string> md = {
      {"format", "focus-block-curves"}, {"block", "8"}, {"window", "64"}, {"sinks", "1"}, {"ctx", "512"}};
  const std::map<std::string, io::F32Tensor> ok = {
      {"missed", {{1, 2, 3}, std::vector<float>(6, 0.5f)}}, {"far", {{1, 2}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}}};
  EXPECT_EQ(write(ok, md), "");
  auto md_with = [&](const std::string& key, const std::string& value) {
    auto m = md;
    m[key] = value;
    return m;
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {write(ok, md_with("block", "x8")), "'block'"},
      {write(ok, md_with("window", "0")), "'window' out of range"},
      {write(ok, md_with("format", "focus-router")), "not a block curves file"},
      {write({{"missed", {{2, 3}, std::vector<float>(6, 0.5f)}}, {"far", {{1, 2}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}}}, md),
       "'missed' must be"},
      {write({{"missed", {{1, 2, 3}, std::vector<float>(6, 0.5f)}}, {"far", {{2, 1}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}}}, md),
       "'far' must be"},
      {write({{"missed", {{1, 2, 3}, {0.5f, -1.f, 0, 0, 0, 0}}}, {"far", {{1, 2}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}}}, md),
       "'missed' holds"},
      {write({{"missed", {{1, 2, 3}, std::vector<float>(6, 0.5f)}}, {"far", {{1, 2}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}},
              {"group_keys", {{2}, {1.f, 1.f}}}},
             md),
       "'group_keys' must be"},
      {write({{"missed", {{1, 2, 3}, std::vector<float>(6, 0.5f)}}, {"far", {{1, 2}, {1.f, 1.f}}}, {"rows", {{1}, {4.f}}},
              {"group_keys", {{1, 2}, {1.f, -3.f}}}},
             md),
       "'group_keys' holds"}};
  for (const auto& [e, word] : cases) {
    EXPECT_NE(e.find(bad), std::string::npos) << e;
    EXPECT_NE(e.find(word), std::string::npos) << e;
  }
}

// On a whole model: every global layer measured (rows beyond the window in every window), the
// curves falling with K to nothing once every block is read; sliding-window layers skipped.
TEST(BlockBudget, MeasuresEveryGlobalLayerOfAModel) {
  auto m = focus::test::random_model(Arch::Llama, 16);
  const int64_t ctx = 40, B = 4, w = 5, S = 1, KM = 16;
  const int64_t bos = m->tok && m->tok->bos() >= 0 ? 1 : 0;  // windows of ctx positions, BOS first if any
  const std::vector<int32_t> ids = focus::test::window_of(2 * (ctx - bos), m->cfg.vocab, 3).ids;
  const BlockMassCurves cv = measure_block_mass(*m, ids, ctx, B, w, S, KM, false);
  const ModelConfig& c = m->cfg;
  int64_t rows = 0;  // per window, rows with a key beyond the window and the sinks
  for (int64_t p = 0; p < ctx; ++p) rows += p - w >= S;
  for (int64_t l = 0; l < c.layers; ++l) {
    EXPECT_EQ(cv.rows[l], 2 * rows) << "layer " << l;
    for (int64_t h = 0; h < c.heads; ++h) {
      EXPECT_GT(cv.far[l * c.heads + h], 0.0);
      EXPECT_LE(cv.missed_at(l, h, 0), cv.far[l * c.heads + h] + 1e-9);
      for (int64_t k = 1; k <= KM; ++k) EXPECT_LE(cv.missed_at(l, h, k), cv.missed_at(l, h, k - 1) + 1e-12);
      EXPECT_NEAR(cv.missed_at(l, h, KM), 0.0, 1e-12);  // (ctx - w) / B < KM: every block read
    }
  }
  const auto k = allocate_block_budget(cv, 2.0);
  int64_t sum = 0;
  for (const auto& kl : k) {
    ASSERT_EQ((int64_t)kl.size(), c.heads);
    for (int64_t x : kl) sum += x;
  }
  EXPECT_EQ(sum, 2 * c.layers * c.heads);
}

// With a hybrid's groups: keys a row's groups read count neither as far nor as block mass, so the
// curves describe what the blocks must still find (against the same float64 reference); the
// curves without them are kept beside.
TEST(BlockBudget, CurvesLeaveOutWhatTheGroupsRead) {
  const ModelConfig c = small_config();
  const int64_t n = 90, KM = 10, B = 4, w = 5, S = 1, G = 3, RH = 2, kq = 1;
  const auto q = random_normal(n * c.q_dim(), 21, 2.f);
  const auto k = random_normal(n * c.kv_dim(), 22, 1.f);
  std::vector<std::vector<int32_t>> key_group(RH, std::vector<int32_t>(n));
  for (int64_t r = 0; r < RH; ++r)
    for (int64_t j = 0; j < n; ++j) key_group[r][j] = (int32_t)((j * 7 + r * 5 + j / 3) % G);
  std::vector<int32_t> qg(n * c.heads * kq);
  for (int64_t i = 0; i < (int64_t)qg.size(); ++i) qg[i] = (int32_t)((i * 5 + i / 7) % G);
  const GroupReads reads{qg.data(), (int)kq, &key_group, c.heads / RH};
  BlockMassCurves with = empty_curves(c, B, w, S, KM), without = with;
  AttentionCall a;
  a.cfg = &c;
  a.q = q.data();
  a.k = k.data();
  a.T = n;
  measure_block_mass_call(a, with, &reads);
  measure_block_mass_call(a, without);
  EXPECT_TRUE(without.group_keys.empty());
  // Around groups the curves as if they were not read are kept too (the group switch): those are
  // the curves without groups, exactly; the groups only take mass away.
  EXPECT_TRUE(without.missed_plain.empty());
  ASSERT_EQ(with.missed_plain.size(), without.missed.size());
  for (size_t i = 0; i < with.missed.size(); ++i) {
    EXPECT_NEAR(with.missed_plain[i], without.missed[i], 1e-12 * (1 + without.missed[i])) << i;
    EXPECT_LE(with.missed[i], with.missed_plain[i] + 1e-12) << i;
  }
  BlockTopKState st = block_state(c, B, k, n);
  for (int64_t K = 0; K <= KM; ++K) {
    BlockTopKSettings s;
    s.block = B;
    s.k = K;
    s.window = w;
    s.sinks = S;
    std::vector<int32_t> sel;
    const int kb = block_topk_select(a, st, s, sel);
    for (int64_t h = 0; h < c.heads; ++h) {
      double missed = 0, far = 0;
      int64_t read = 0;
      for (int64_t p = w + S; p < n; ++p) {
        const std::vector<double> pr = softmax_row(q, k, c, p, h);
        const int32_t* slots = sel.data() + (p * c.heads + h) * kb;
        for (int64_t j = S; j <= p - w; ++j) {
          if (key_group[h / (c.heads / RH)][j] == qg[(p * c.heads + h) * kq]) {  // the groups read it
            ++read;
            continue;
          }
          far += pr[j];
          if (std::find(slots, slots + kb, (int32_t)(j / B)) == slots + kb) missed += pr[j];
        }
      }
      EXPECT_NEAR(with.missed_at(0, h, K), missed, 1e-4 * (1 + missed)) << "head " << h << " K " << K;
      if (K == 0) {
        EXPECT_NEAR(with.far[h], far, 1e-4 * (1 + far));
        EXPECT_LT(with.far[h], without.far[h] - 1e-3);  // the groups took some of it
        ASSERT_EQ((int64_t)with.group_keys.size(), c.layers * c.heads);
        EXPECT_EQ(with.group_keys[h], (double)read) << "head " << h;  // what the groups cost
        EXPECT_GT(read, 0);
      }
    }
  }
}
