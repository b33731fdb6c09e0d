// Near blocks (per-head window widths) in block top-k and its budgets: the selection against a
// brute-force definition on the prefill and decoding paths, the calibration's two-dimensional
// curves against that selection, the allocation against an exhaustive search, and the files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "focus/focus_model.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::random_normal;
using focus::test::softmax_row;
using focus::test::rows_call;

namespace {

// The blocks (besides the window and the sinks) row p, head h reads by the definition: the block
// of its last far key, the n complete blocks just before it, and the K of the other complete
// blocks with the largest Quest bound (ties to the lower block), all of them when they are fewer.
std::set<int64_t> reference_blocks(const std::vector<float>& q, const std::vector<float>& k, const ModelConfig& c,
                                   int64_t B, int64_t w, int64_t S, int64_t n, int64_t K, int64_t p, int64_t h) {
  const int64_t f = p - w, hd = c.head_dim, g = h / (c.heads / c.kv_heads), lo = S / B;
  if (f < S) return {};
  const int64_t cur = f / B;
  std::set<int64_t> out = {cur};
  if (cur - lo <= n + K) {
    for (int64_t b = lo; b < cur; ++b) out.insert(b);
    return out;
  }
  for (int64_t b = std::max(lo, cur - n); b < cur; ++b) out.insert(b);
  std::vector<std::pair<double, int64_t>> cand;
  for (int64_t b = lo; b < cur - n; ++b) {
    double bound = 0;
    for (int64_t d = 0; d < hd; ++d) {
      double mn = INFINITY, mx = -INFINITY;
      for (int64_t j = b * B; j < (b + 1) * B; ++j) {
        mn = std::min<double>(mn, k[j * c.kv_dim() + g * hd + d]);
        mx = std::max<double>(mx, k[j * c.kv_dim() + g * hd + d]);
      }
      const double qd = q[p * c.q_dim() + h * hd + d];
      bound += std::max(qd * mn, qd * mx);
    }
    cand.push_back({bound, b});
  }
  std::sort(cand.begin(), cand.end(),
            [](const auto& x, const auto& y) { return x.first > y.first || (x.first == y.first && x.second < y.second); });
  for (int64_t i = 0; i < std::min<int64_t>(K, (int64_t)cand.size()); ++i) out.insert(cand[i].second);
  return out;
}

std::set<int64_t> listed(const std::vector<int32_t>& qg, int kq, int64_t row, int64_t heads, int64_t h) {
  std::set<int64_t> s;
  for (int i = 0; i < kq; ++i) {
    const int32_t b = qg[(row * heads + h) * kq + i];
    if (b >= 0) EXPECT_TRUE(s.insert(b).second) << "block " << b << " listed twice";
  }
  return s;
}

}  // namespace

// Each head reads its near blocks and its top K of the rest, on the whole-prefill path and on the
// few-rows (decoding) path, with per-head near counts and budgets that differ.
TEST(BlockNear, SelectionMatchesDefinition) {
  const ModelConfig c = focus::test::one_global_layer_config();  // 4 heads, 2 kv heads
  const int64_t n = 160, B = 4, w = 6, S = 1;
  const auto q = random_normal(n * c.q_dim(), 21, 1.f);
  const auto k = random_normal(n * c.kv_dim(), 22, 1.f);
  const std::vector<int64_t> near = {0, 2, 5, 40}, kh = {3, 0, 2, 1};
  BlockTopKSettings s;
  s.block = B;
  s.window = w;
  s.sinks = S;
  s.set_head_k(kh, near);
  EXPECT_EQ(s.k, 41);
  BlockTopKState st(B, c.kv_heads, c.head_dim);
  st.append(cpu::KvView(k.data()), c.kv_dim(), n);
  std::vector<int32_t> qg;
  const int kq = block_topk_select(rows_call(c, q, k, 0, n), st, s, qg);
  int64_t checked = 0;
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < c.heads; ++h) {
      EXPECT_EQ(listed(qg, kq, p, c.heads, h), reference_blocks(q, k, c, B, w, S, near[h], kh[h], p, h))
          << "row " << p << " head " << h;
      ++checked;
    }
  EXPECT_EQ(checked, n * c.heads);
  // Decoding-sized calls (the split path): the last rows, two at a time.
  for (int64_t p0 = n - 6; p0 < n; p0 += 2) {
    std::vector<int32_t> qd;
    const int kd = block_topk_select(rows_call(c, q, k, p0, 2), st, s, qd);
    for (int64_t t = 0; t < 2; ++t)
      for (int64_t h = 0; h < c.heads; ++h)
        EXPECT_EQ(listed(qd, kd, t, c.heads, h), reference_blocks(q, k, c, B, w, S, near[h], kh[h], p0 + t, h))
            << "row " << p0 + t << " head " << h;
  }
  // Near blocks with blocks chosen once per tile of rows: refused.
  s.select_every = 4;
  EXPECT_NE(focus::test::error_of([&] { block_topk_select(rows_call(c, q, k, 0, n), st, s, qg); }).find("every=1"),
            std::string::npos);
}

// missed(N, K) is, summed over rows, the probability beyond the window and the sinks that the
// selection with N near and K ranked blocks leaves unread; N = 0 is the curve without near blocks.
TEST(BlockNear, CurvesMatchTheSelection) {
  const ModelConfig c = focus::test::one_global_layer_config();
  const int64_t n = 100, B = 4, w = 5, S = 1, KM = 6, NM = 4;
  const auto q = random_normal(n * c.q_dim(), 31, 2.f);
  const auto k = random_normal(n * c.kv_dim(), 32, 1.f);
  BlockMassCurves cv = block_mass_curves(c, B, w, S, KM, NM), flat = block_mass_curves(c, B, w, S, KM);
  measure_block_mass_call(rows_call(c, q, k, 0, 41), cv);
  measure_block_mass_call(rows_call(c, q, k, 41, n - 41), cv);
  measure_block_mass_call(rows_call(c, q, k, 0, n), flat);
  BlockTopKState st(B, c.kv_heads, c.head_dim);
  st.append(cpu::KvView(k.data()), c.kv_dim(), n);
  bool near_helps = false;
  for (int64_t N = 0; N <= NM; ++N)
    for (int64_t K = 0; K <= KM; ++K) {
      std::vector<int32_t> qg;
      const int kq = focus::test::select_blocks(c, q, k, n, st, B, w, S, N, K, qg);
      for (int64_t h = 0; h < c.heads; ++h) {
        double missed = 0;
        for (int64_t p = 0; p < n; ++p) {
          const int64_t f = p - w;
          if (f < S) continue;
          const std::vector<double> pr = softmax_row(q, k, c, p, h);
          const std::set<int64_t> read = listed(qg, kq, p, c.heads, h);
          for (int64_t j = S; j <= f; ++j)
            if (!read.count(j / B)) missed += pr[j];
        }
        EXPECT_NEAR(cv.missed_at(0, h, N, K), missed, 1e-4 * (1 + missed)) << "head " << h << " N " << N << " K " << K;
        if (N == 0) EXPECT_NEAR(cv.missed_at(0, h, 0, K), flat.missed_at(0, h, K), 1e-9 * (1 + missed));
        if (N > 0) near_helps |= cv.missed_at(0, h, N, K) < cv.missed_at(0, h, N - 1, K) - 1e-6;
      }
    }
  EXPECT_TRUE(near_helps) << "some near block holds mass the ranked ones miss";
}

// With near blocks the allocation spends exactly the budget on N + K, within near_max, k_max and
// the cap, and reaches the exhaustive optimum when each head's best-split curve is convex.
TEST(BlockNear, AllocationIsOptimalOnConvexBestSplits) {
  ModelConfig c = focus::test::one_global_layer_config();
  c.layers = 2;
  c.heads = 3;
  c.layer_sliding_window = {0, 0};
  const int64_t KM = 4, NM = 3, top = KM + NM;
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    BlockMassCurves cv = block_mass_curves(c, 8, 16, 1, KM, NM);
    cv.rows = {10, 10};
    const auto r = random_normal(c.layers * c.heads * (top + 1) * 3, seed, 1.f);
    // missed(N, K) = base(N + K) + extra(N, K) >= base, with one split of each c at base exactly:
    // the best-split curve is base, decreasing and convex.
    for (int64_t l = 0; l < c.layers; ++l)
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t at = (l * c.heads + h) * (top + 1) * 3;
        std::vector<double> gain(top);
        for (int64_t i = 0; i < top; ++i) gain[i] = std::fabs(r[at + i]) + 0.01;
        std::sort(gain.rbegin(), gain.rend());
        std::vector<double> base(top + 1, 0.0);
        for (int64_t i = top - 1; i >= 0; --i) base[i] = base[i + 1] + gain[i];
        for (int64_t N = 0; N <= NM; ++N)
          for (int64_t K = 0; K <= KM; ++K) {
            const int64_t cc = N + K, n_lo = std::max<int64_t>(0, cc - KM), n_hi = std::min(NM, cc);
            // The split of cc blocks at base: one of its valid near counts, picked by the seed.
            const int64_t best_n = n_lo + (int64_t)(std::fabs(r[at + top + cc]) * 7) % (n_hi - n_lo + 1);
            const double extra = N == best_n ? 0.0 : 0.05 + std::fabs(r[at + 2 * top + N]);
            cv.missed[((l * c.heads + h) * (NM + 1) + N) * (KM + 1) + K] = base[cc] + extra;
          }
      }
    for (double mean : {0.0, 1.0, 2.5, 4.0, 7.0, 9.0}) {
      for (int64_t cap : {int64_t{-1}, int64_t{5}}) {
        SCOPED_TRACE("seed " + std::to_string(seed) + " mean " + std::to_string(mean) + " cap " + std::to_string(cap));
        std::vector<std::vector<int64_t>> near;
        const auto k = allocate_block_budget(cv, mean, cap, &near);
        const int64_t most = cap >= 0 ? cap : top;
        ASSERT_EQ(near.size(), k.size());
        int64_t sum = 0;
        double cost = 0;
        for (int64_t l = 0; l < c.layers; ++l)
          for (int64_t h = 0; h < c.heads; ++h) {
            EXPECT_GE(near[l][h], 0);
            EXPECT_LE(near[l][h], NM);
            EXPECT_LE(k[l][h], KM);
            EXPECT_LE(k[l][h] + near[l][h], most);
            sum += k[l][h] + near[l][h];
            cost += cv.missed_at(l, h, near[l][h], k[l][h]);
          }
        const int64_t total = std::min<int64_t>((int64_t)std::floor(mean * 6), 6 * most);
        EXPECT_EQ(sum, total);
        // Every split of total over the 6 heads, each head's share at its best (N, K).
        double best = INFINITY;
        std::function<void(int64_t, int64_t, double)> walk = [&](int64_t i, int64_t left, double acc) {
          if (i == 6) {
            if (left == 0) best = std::min(best, acc);
            return;
          }
          for (int64_t cc = 0; cc <= std::min(most, left); ++cc) {
            double m = INFINITY;
            for (int64_t N = std::max<int64_t>(0, cc - KM); N <= std::min(NM, cc); ++N)
              m = std::min(m, cv.missed_at(i / 3, i % 3, N, cc - N));
            walk(i + 1, left - cc, acc + m);
          }
        };
        walk(0, total, 0.0);
        EXPECT_NEAR(cost, best, 1e-9);
      }
    }
  }
}

// Budget files carry the near counts to `blocktopk:budget=` and to the hybrid's routers; curves
// files carry near_max; mismatched near lists are errors naming the file.
TEST(BlockNear, FilesCarryNearCounts) {
  const ModelConfig c = focus::test::one_global_layer_config();
  BlockBudget b = focus::test::small_budget({{0, 3, 1, 2}});
  b.near = {{2, 0, 1, 0}};
  const std::string path = ::testing::TempDir() + "/focus_near_budget.json";
  save_block_budget(path, b);
  const BlockBudget r = load_block_budget(path);
  EXPECT_EQ(r.near, b.near);
  const BlockTopKSettings s = block_topk_settings(AttentionOptions::parse("budget=" + path, "blocktopk"), c, 0);
  EXPECT_EQ(s.head_near, b.near[0]);
  EXPECT_EQ(s.k, 3);  // the largest K + N: 3 + 0 and 2 + 1
  EXPECT_EQ(s.near_of(0), 2);

  b.near = {{1, 2, 3}};
  save_block_budget(path, b);
  const std::string e = focus::test::error_of([&] { load_block_budget(path); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("near counts"), std::string::npos) << e;

  FocusRouters f;
  f.settings.asymmetric = true;
  f.router_of_layer = {0};
  set_block_budget(f, c, {{1, 1, 1, 1}}, "x.json", {{0, 4, 0, 0}});
  EXPECT_EQ(f.settings.blocks, 5);
  EXPECT_EQ(f.block_near, (std::vector<std::vector<int64_t>>{{0, 4, 0, 0}}));
  EXPECT_NE(focus::test::error_of([&] { set_block_budget(f, c, {{1, 1, 1, 1}}, "x.json", {{0, 4}}); }).find("x.json"),
            std::string::npos);

  BlockMassCurves cv = block_mass_curves(c, 4, 5, 1, 3, 2);
  cv.rows = {9};
  for (size_t i = 0; i < cv.missed.size(); ++i) cv.missed[i] = 9.0 * (double)(cv.missed.size() - i);
  const std::string cp = ::testing::TempDir() + "/focus_near_curves.safetensors";
  save_block_curves(cp, cv, 128);
  const BlockMassCurves back = load_block_curves(cp, nullptr);
  EXPECT_EQ(back.near_max, 2);
  EXPECT_EQ(back.k_max, 3);
  ASSERT_EQ(back.missed.size(), cv.missed.size());
  for (size_t i = 0; i < cv.missed.size(); ++i) EXPECT_NEAR(back.missed[i], cv.missed[i], 1e-5 * cv.missed[i]);
}

// The near blocks' weight: the allocation minimises missed(N, K) - (w - 1) * (what the N near
// blocks read), so a larger weight moves blocks from ranked to near ones, within the same total;
// weight 1 is the plain allocation. Not positive: refused.
TEST(BlockNear, NearWeightMovesBlocksToTheWindow) {
  ModelConfig c = focus::test::one_global_layer_config();
  c.layers = 2;
  c.layer_sliding_window = {0, 0};
  const int64_t KM = 6, NM = 4;
  int64_t near_1 = 0, near_4 = 0;
  for (uint32_t seed = 1; seed <= 6; ++seed) {
    BlockMassCurves cv = block_mass_curves(c, 4, 8, 1, KM, NM);
    cv.rows = {10, 10};
    const auto x = random_normal(cv.missed.size(), seed, 1.f);
    for (int64_t lh = 0; lh < 8; ++lh)
      for (int64_t N = 0; N <= NM; ++N)
        for (int64_t K = 0; K <= KM; ++K) {
          const size_t i = (lh * (NM + 1) + N) * (KM + 1) + K;
          cv.missed[i] = 10.0 * std::exp(-0.25 * (double)(N + K) * (1 + 0.5 * std::fabs(x[i])));
        }
    for (double mean : {1.0, 2.5, 4.0}) {
      std::vector<std::vector<int64_t>> n1, n4;
      const auto k1 = allocate_block_budget(cv, mean, -1, &n1);
      EXPECT_EQ(allocate_block_budget(cv, mean, -1, nullptr, nullptr, BudgetWeights{1.0, 1.0}), k1);
      const auto k4 = allocate_block_budget(cv, mean, -1, &n4, nullptr, BudgetWeights{1.0, 4.0});
      int64_t s1 = 0, s4 = 0;
      for (int64_t l = 0; l < 2; ++l)
        for (int64_t h = 0; h < 4; ++h) {
          s1 += k1[l][h] + n1[l][h];
          s4 += k4[l][h] + n4[l][h];
          near_1 += n1[l][h];
          near_4 += n4[l][h];
        }
      EXPECT_EQ(s1, s4);
    }
  }
  EXPECT_GT(near_4, near_1);
  BlockMassCurves cv = block_mass_curves(c, 4, 8, 1, KM, NM);
  cv.rows = {1, 1};
  EXPECT_NE(focus::test::error_of([&] { allocate_block_budget(cv, 1.0, -1, nullptr, nullptr, BudgetWeights{1.0, -2.0}); })
                .find("near blocks' weight"),
            std::string::npos);
}
