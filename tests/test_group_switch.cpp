// The group switch of the hybrid's budgets (focus/block_budget.h): heads that drop their groups and
// read blocks alone (the calibration's curves without the groups: test_block_budget.cpp). The
// allocation against its pure candidates and a hand-made case, the files, and the policy: every head switched off is block top-k with the same budgets, every head on is the
// hybrid, a mixture decodes as it prefills and is causal.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "focus/focus_attention.h"
#include "focus/focus_model.h"
#include "io/safetensors_writer.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::hidden_of;
using focus::test::max_abs_diff;
using focus::test::random_normal;

namespace {

std::string temp_file(const std::string& name) { return ::testing::TempDir() + "/focus_switch_" + name; }

std::vector<std::vector<int64_t>> per_head(const ModelConfig& c, const std::function<int64_t(int64_t, int64_t)>& v) {
  std::vector<std::vector<int64_t>> out(c.layers);
  for (int64_t l = 0; l < c.layers; ++l)
    if (c.layer_sliding_window[l] == 0)
      for (int64_t h = 0; h < c.heads; ++h) out[l].push_back(v(l, h));
  return out;
}

}  // namespace

// The allocation: a head whose group holds what its blocks miss keeps it, a head whose group holds
// nothing the blocks do not find drops it; groups that cost nothing are all kept, groups that cost
// more than the budget none; never worse than all kept or none at the same budget, within budget.
TEST(GroupSwitch, AllocationKeepsTheGroupsThatPay) {
  ModelConfig c = focus::test::one_global_layer_config();
  c.heads = 2;
  c.kv_heads = 1;
  const int64_t KM = 6;
  BlockMassCurves cv = block_mass_curves(c, 4, 8, 1, KM);
  cv.rows = {1};
  cv.group_keys = {8.0, 8.0};  // each group reads 2 blocks' worth
  cv.missed_plain.assign(cv.missed.size(), 0.0);
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t K = 0; K <= KM; ++K) {
      const double plain = 0.5 * std::pow(0.6, (double)K);
      cv.missed_plain[h * (KM + 1) + K] = plain;
      // head 0: its group holds 0.3 the blocks would take long to find; head 1: nothing.
      cv.missed[h * (KM + 1) + K] = h == 0 ? std::max(0.0, plain - 0.3) : plain;
    }
  std::vector<std::vector<int64_t>> near, group;
  auto k = allocate_block_budget(cv, 3.0, -1, &near, &group);
  EXPECT_TRUE(near.empty());
  EXPECT_EQ(group, (std::vector<std::vector<int64_t>>{{1, 0}}));
  BudgetCost used = budget_cost(cv, k, {}, group);
  EXPECT_LE(used.blocks, 6.0 + 1e-9);
  EXPECT_GE(used.blocks, 5.0);  // whole blocks up to the budget
  // Free groups (no keys) that take mass: all kept; groups dearer than the whole budget: none.
  BlockMassCurves free = cv;
  free.group_keys = {0.0, 0.0};
  for (size_t i = 0; i < free.missed.size(); ++i) free.missed[i] = 0.5 * free.missed_plain[i];
  allocate_block_budget(free, 2.0, -1, nullptr, &group);
  EXPECT_EQ(group, (std::vector<std::vector<int64_t>>{{1, 1}}));
  BlockMassCurves dear = cv;
  dear.group_keys = {100.0, 100.0};
  k = allocate_block_budget(dear, 3.0, -1, nullptr, &group);
  EXPECT_EQ(group, (std::vector<std::vector<int64_t>>{{0, 0}}));
  BlockMassCurves blocks_alone = dear;  // the same budget on the curves without groups
  blocks_alone.missed = dear.missed_plain;
  blocks_alone.missed_plain.clear();
  blocks_alone.group_keys.clear();
  EXPECT_EQ(k, allocate_block_budget(blocks_alone, 3.0));
  // Random curves with near blocks: within budget, and at most what all-kept or none leaves.
  ModelConfig c2 = focus::test::one_global_layer_config();
  c2.layers = 2;
  c2.layer_sliding_window = {0, 0};
  const int64_t NM = 2;
  int64_t kept_at_1 = 0, kept_at_4 = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    BlockMassCurves r = block_mass_curves(c2, 4, 8, 1, KM, NM);
    r.rows = {10, 10};
    const auto x = random_normal(r.missed.size() * 2 + 8, seed, 1.f);
    r.missed_plain.assign(r.missed.size(), 0.0);
    r.group_keys.assign(8, 0.0);
    for (int64_t i = 0; i < 8; ++i) r.group_keys[i] = 10.0 * 4.0 * std::fabs(x[r.missed.size() * 2 + i]);
    for (int64_t lh = 0; lh < 8; ++lh)
      for (int64_t N = 0; N <= NM; ++N)
        for (int64_t K = 0; K <= KM; ++K) {
          const size_t i = (lh * (NM + 1) + N) * (KM + 1) + K;
          const double plain = 10.0 * std::exp(-0.3 * (double)(N + K) * (1 + 0.5 * std::fabs(x[i])));
          r.missed_plain[i] = plain;
          r.missed[i] = plain * (0.3 + 0.6 * std::fabs(std::tanh(x[r.missed.size() + i])));
        }
    for (double mean : {0.5, 2.0, 3.5, 6.0}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + " mean " + std::to_string(mean));
      std::vector<std::vector<int64_t>> n1, g1, g4;
      const auto k1 = allocate_block_budget(r, mean, -1, &n1, &g1);
      // The groups' mass weighted 4 times a block's: more groups kept, within the same budget.
      const auto k4 = allocate_block_budget(r, mean, -1, nullptr, &g4, BudgetWeights{4.0, 1.0});
      EXPECT_LE(budget_cost(r, k4, {}, g4).blocks, mean * 8 + 1e-9);
      for (int64_t l = 0; l < 2; ++l)
        for (int64_t h = 0; h < 4; ++h) {
          kept_at_1 += g1[l][h];
          kept_at_4 += g4[l][h];
        }
      const BudgetCost mixed = budget_cost(r, k1, n1, g1);
      EXPECT_LE(mixed.blocks, mean * 8 + 1e-9);
      // None kept: the plain curves' own allocation with the whole budget.
      BlockMassCurves plain = r;
      plain.missed = r.missed_plain;
      plain.missed_plain.clear();
      plain.group_keys.clear();
      std::vector<std::vector<int64_t>> n0;
      const auto k0 = allocate_block_budget(plain, mean, -1, &n0);
      EXPECT_LE(mixed.missed, budget_cost(plain, k0, n0, {}).missed + 1e-9);
      // All kept: the grouped curves' allocation with what the groups leave of the budget.
      double g_all = 0;
      for (double gk : r.group_keys) g_all += gk / 10.0 / 4.0;
      const double rest = std::floor(mean * 8 - g_all + 1e-9);
      if (rest >= 0) {
        std::vector<std::vector<int64_t>> n2;
        BlockMassCurves grouped = r;
        grouped.missed_plain.clear();
        const auto k2 = allocate_block_budget(grouped, rest / 8.0, -1, &n2);
        EXPECT_LE(mixed.missed, budget_cost(grouped, k2, n2, {}).missed + 1e-9);
      }
    }
  }
  EXPECT_GT(kept_at_4, kept_at_1);
  EXPECT_GT(kept_at_1, 0);
  EXPECT_LT(kept_at_4, 6 * 4 * 8);
  // Curves without the plain half, or a weight that is not positive: refused.
  EXPECT_NE(focus::test::error_of([&] { allocate_block_budget(cv, 1.0, -1, nullptr, &group, BudgetWeights{0.0, 1.0}); }).find("weight"),
            std::string::npos);
  BlockMassCurves none = block_mass_curves(c, 4, 8, 1, KM);
  none.rows = {1};
  EXPECT_NE(focus::test::error_of([&] { allocate_block_budget(none, 1.0, -1, nullptr, &group); }).find("--focus"),
            std::string::npos);
}

// Budget files and curves files carry the switch; focus.json keeps it; bad switches are errors
// naming the file; block top-k alone refuses a budget that switches groups.
TEST(GroupSwitch, FilesCarryTheSwitch) {
  const ModelConfig c = focus::test::one_global_layer_config();
  BlockBudget b = focus::test::small_budget({{0, 3, 1, 2}});
  b.group = {{1, 0, 0, 1}};
  const std::string path = temp_file("budget.json");
  b.weights = {2.5, 1.0};
  save_block_budget(path, b);
  EXPECT_EQ(load_block_budget(path).group, b.group);
  EXPECT_EQ(load_block_budget(path).weights.group, 2.5);  // kept for the record
  const std::string e1 = focus::test::error_of(
      [&] { block_topk_settings(AttentionOptions::parse("budget=" + path, "blocktopk"), c, 0); });
  EXPECT_NE(e1.find(path), std::string::npos) << e1;
  EXPECT_NE(e1.find("--group-switch"), std::string::npos) << e1;
  b.group = {{1, 2, 0, 1}};
  save_block_budget(path, b);
  const std::string e2 = focus::test::error_of([&] { load_block_budget(path); });
  EXPECT_NE(e2.find(path), std::string::npos) << e2;
  EXPECT_NE(e2.find("'group'"), std::string::npos) << e2;

  BlockMassCurves cv = block_mass_curves(c, 4, 5, 1, 3, 1);
  cv.rows = {9};
  cv.group_keys = {9, 18, 27, 36};
  cv.missed_plain.assign(cv.missed.size(), 0.0);
  for (size_t i = 0; i < cv.missed.size(); ++i) {
    cv.missed[i] = 9.0 * (double)(i + 1);
    cv.missed_plain[i] = 18.0 * (double)(i + 1);
  }
  const std::string cp = temp_file("curves.safetensors");
  save_block_curves(cp, cv, 64);
  const BlockMassCurves back = load_block_curves(cp, nullptr);
  ASSERT_EQ(back.missed_plain.size(), cv.missed_plain.size());
  for (size_t i = 0; i < cv.missed_plain.size(); ++i)
    EXPECT_NEAR(back.missed_plain[i], cv.missed_plain[i], 1e-5 * cv.missed_plain[i]);
}

// The policy: every head switched off reads what block top-k with the same budgets reads (the
// same outputs through another kernel, for routers without far-pair terms: those weight the
// blocks' pairs too); every head on is the hybrid without a switch; a mixture
// lies between them, decodes token by token as one call computes it, is causal, and survives
// focus.json.
TEST(GroupSwitch, HeadsWithoutGroupsReadBlocksAlone) {
  auto m = focus::test::random_model(Arch::Llama, 16);
  const ModelConfig& c = m->cfg;
  const int64_t n = 60, D = c.dim, B = 4, w = 3;
  const std::vector<int32_t> ids = focus::test::window_of(n, c.vocab, 11).ids;
  FocusSettings s = focus::test::asym_settings(4, 1, w);
  s.per_kv_head = true;
  FocusRouters base = focus_init(c, s, 8);
  base.settings.block_size = B;
  const auto k = per_head(c, [](int64_t l, int64_t h) { return (l + h) % 3; });
  const auto near = per_head(c, [](int64_t l, int64_t h) { return (l * 2 + h) % 2; });
  auto run = [&](const AttentionPlan& plan, double* density) {
    AttentionStats st;
    const auto out = hidden_of(*m, ids, &plan, &st);
    *density = st.density();
    return out;
  };
  auto with_switch = [&](const std::vector<std::vector<int64_t>>& group) {
    FocusRouters f = base;
    set_block_budget(f, c, k, "test", near, group);
    return f;
  };
  double d_hyb = 0, d_on = 0, d_off = 0, d_btk = 0, d_mix = 0;
  const FocusRouters hybrid = with_switch({});
  const auto out_hyb = run(focus_plan(c, hybrid), &d_hyb);
  const auto out_on = run(focus_plan(c, with_switch(per_head(c, [](int64_t, int64_t) { return 1; }))), &d_on);
  EXPECT_EQ(max_abs_diff(out_on, out_hyb), 0.0);
  EXPECT_EQ(d_on, d_hyb);

  const auto out_off = run(focus_plan(c, with_switch(per_head(c, [](int64_t, int64_t) { return 0; }))), &d_off);
  BlockBudget b = focus::test::small_budget(k);  // blocks of B = 4
  b.window = w;
  b.near = near;
  const std::string path = temp_file("btk.json");
  save_block_budget(path, b);
  const auto out_btk = run(make_attention_plan(c, "blocktopk:budget=" + path), &d_btk);
  EXPECT_NEAR(d_off, d_btk, 1e-12);
  EXPECT_LT(max_abs_diff(out_off, out_btk), 1e-5);
  EXPECT_LT(d_off, d_hyb - 1e-3);  // the groups read keys the blocks do not

  const FocusRouters mixed = with_switch(per_head(c, [](int64_t l, int64_t h) { return (l + h) % 2; }));
  const AttentionPlan plan = focus_plan(c, mixed);
  const auto out_mix = run(plan, &d_mix);
  EXPECT_GT(d_mix, d_off + 1e-4);
  EXPECT_LT(d_mix, d_hyb - 1e-4);
  EXPECT_GT(max_abs_diff(out_mix, out_hyb), 1e-4);
  EXPECT_GT(max_abs_diff(out_mix, out_off), 1e-4);
  EXPECT_LT(max_abs_diff(focus::test::hidden_decoded(*m, ids, &plan, 30, 22), out_mix), 1e-5);
  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 41);
  EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &plan), out_mix, 0, 41 * D), 1e-5);

  const std::string dir = (std::filesystem::temp_directory_path() / "focus_test_switch_routers").string();
  save_focus(mixed, dir, c, "random");
  const FocusRouters g = load_focus(dir, c);
  EXPECT_EQ(g.block_group, mixed.block_group);
  double d_loaded = 0;
  EXPECT_EQ(max_abs_diff(run(focus_plan(c, g), &d_loaded), out_mix), 0.0);
  {  // a switch that is neither 0 nor 1 in focus.json is refused, naming the file
    std::string text = read_file(dir + "/focus.json");
    const size_t at = text.find("\"block_group\": [");
    ASSERT_NE(at, std::string::npos);
    const size_t one = text.find('1', at);
    ASSERT_NE(one, std::string::npos);
    text.replace(one, 1, "3");
    io::write_file_atomic(dir + "/focus.json", text);
    const std::string e = focus::test::error_of([&] { load_focus(dir, c); });
    EXPECT_NE(e.find("focus.json"), std::string::npos) << e;
    EXPECT_NE(e.find("group switch"), std::string::npos) << e;
  }
}
