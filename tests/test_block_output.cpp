// Block budgets by output error (`focus budget --metric output`): the calibration's curves against
// their definition, the distance between the head's dense output and the output of the keys a
// selection reads (renormalised), computed in float64 from the selection block top-k makes, with
// near blocks and around a hybrid's groups; and the metric through the curves and budget files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/mapped_file.h"
#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::random_normal;
using focus::test::rows_call;
using focus::test::softmax_row;

namespace {

// ||o_read - o|| of row p, head h: o over every key 0 .. p, o_read over those for which read(j).
template <class Read>
double output_error(const std::vector<double>& pr, const std::vector<float>& v, const ModelConfig& c, int64_t p,
                    int64_t h, Read read) {
  const int64_t hd = c.head_dim, g = h / (c.heads / c.kv_heads);
  std::vector<double> o(hd, 0.0), os(hd, 0.0);
  double zs = 0;
  for (int64_t j = 0; j <= p; ++j) {
    const bool r = read(j);
    zs += r ? pr[j] : 0.0;
    for (int64_t d = 0; d < hd; ++d) {
      const double x = pr[j] * v[j * c.kv_dim() + g * hd + d];
      o[d] += x;
      if (r) os[d] += x;
    }
  }
  double e2 = 0;
  for (int64_t d = 0; d < hd; ++d) e2 += (os[d] / zs - o[d]) * (os[d] / zs - o[d]);
  return std::sqrt(e2);
}

std::set<int64_t> listed(const std::vector<int32_t>& sel, int kq, int64_t row, int64_t heads, int64_t h) {
  std::set<int64_t> s;
  for (int i = 0; i < kq; ++i)
    if (sel[(row * heads + h) * kq + i] >= 0) s.insert(sel[(row * heads + h) * kq + i]);
  return s;
}

}  // namespace

// missed(N, K) under the output metric is, summed over rows, ||o_read - o|| for the keys block top-k
// reads with N near and K ranked blocks (with the window, the sinks and the block of the last far
// key), for every N and K; measured in two calls as in one; around groups the keys they read are
// read too, and the curves as if they were not are those without groups.
TEST(BlockOutput, CurvesMatchTheirDefinition) {
  const ModelConfig c = focus::test::one_global_layer_config();
  const int64_t n = 90, B = 4, w = 5, S = 1, KM = 6, NM = 3, G = 3, RH = 2;
  const auto q = random_normal(n * c.q_dim(), 41, 2.f);
  const auto k = random_normal(n * c.kv_dim(), 42, 1.f);
  const auto v = random_normal(n * c.kv_dim(), 43, 1.f);
  std::vector<std::vector<int32_t>> key_group(RH, std::vector<int32_t>(n));
  for (int64_t r = 0; r < RH; ++r)
    for (int64_t j = 0; j < n; ++j) key_group[r][j] = (int32_t)((j * 7 + r * 5 + j / 3) % G);
  std::vector<int32_t> qg(n * c.heads);
  for (int64_t i = 0; i < (int64_t)qg.size(); ++i) qg[i] = (int32_t)((i * 5 + i / 7) % G);
  const GroupReads reads{qg.data(), 1, &key_group, c.heads / RH};

  BlockMassCurves plain = block_mass_curves(c, B, w, S, KM, NM), split = plain, around = plain, mass = plain;
  for (BlockMassCurves* cv : {&plain, &split, &around}) cv->metric = BlockMetric::Output;
  auto with_v = [&](AttentionCall a) {
    a.v = v.data();
    return a;
  };
  measure_block_mass_call(with_v(rows_call(c, q, k, 0, n)), plain);
  measure_block_mass_call(with_v(rows_call(c, q, k, 0, 37)), split);
  measure_block_mass_call(with_v(rows_call(c, q, k, 37, n - 37)), split);
  measure_block_mass_call(with_v(rows_call(c, q, k, 0, n)), around, &reads);
  measure_block_mass_call(rows_call(c, q, k, 0, n), mass);

  BlockTopKState st(B, c.kv_heads, c.head_dim);
  st.append(cpu::KvView(k.data()), c.kv_dim(), n);
  bool differs_from_mass = false;
  for (int64_t N = 0; N <= NM; ++N)
    for (int64_t K = 0; K <= KM; ++K) {
      std::vector<int32_t> sel;
      const int kq = focus::test::select_blocks(c, q, k, n, st, B, w, S, N, K, sel);
      for (int64_t h = 0; h < c.heads; ++h) {
        double err = 0, err_groups = 0;
        for (int64_t p = 0; p < n; ++p) {
          const int64_t f = p - w;
          if (f < S) continue;
          const std::vector<double> pr = softmax_row(q, k, c, p, h);
          const std::set<int64_t> blocks = listed(sel, kq, p, c.heads, h);
          auto read = [&](int64_t j) { return j < S || j > f || blocks.count(j / B) > 0; };
          err += output_error(pr, v, c, p, h, read);
          const int32_t group = qg[p * c.heads + h];
          err_groups += output_error(pr, v, c, p, h, [&](int64_t j) {
            return read(j) || key_group[h / (c.heads / RH)][j] == group;
          });
        }
        const std::string at = "head " + std::to_string(h) + " N " + std::to_string(N) + " K " + std::to_string(K);
        EXPECT_NEAR(plain.missed_at(0, h, N, K), err, 1e-4 * (1 + err)) << at;
        EXPECT_NEAR(split.missed_at(0, h, N, K), err, 1e-4 * (1 + err)) << at;
        EXPECT_NEAR(around.missed_at(0, h, N, K), err_groups, 1e-4 * (1 + err_groups)) << at;
        EXPECT_NEAR(around.missed_plain_at(0, h, N, K), err, 1e-4 * (1 + err)) << at;
        differs_from_mass |= std::abs(plain.missed_at(0, h, N, K) - mass.missed_at(0, h, N, K)) > 1e-3 * (1 + err);
      }
    }
  EXPECT_TRUE(differs_from_mass) << "the output curves are not the mass curves";
  // The far probability is the same under either metric.
  for (int64_t h = 0; h < c.heads; ++h) EXPECT_NEAR(plain.far[h], mass.far[h], 1e-9 * (1 + mass.far[h]));
  // The values are needed.
  BlockMassCurves no_v = block_mass_curves(c, B, w, S, KM, NM);
  no_v.metric = BlockMetric::Output;
  EXPECT_THROW(measure_block_mass_call(rows_call(c, q, k, 0, n), no_v), Error);
}

// The metric travels with the curves and the budgets made from them; an unknown one is refused by
// name, and files written before it read as mass.
TEST(BlockOutput, MetricInFiles) {
  const ModelConfig c = focus::test::one_global_layer_config();
  const int64_t n = 60;
  const auto q = random_normal(n * c.q_dim(), 51, 2.f);
  const auto k = random_normal(n * c.kv_dim(), 52, 1.f);
  const auto v = random_normal(n * c.kv_dim(), 53, 1.f);
  BlockMassCurves cv = block_mass_curves(c, 4, 5, 1, 6);
  cv.metric = BlockMetric::Output;
  AttentionCall a = rows_call(c, q, k, 0, n);
  a.v = v.data();
  measure_block_mass_call(a, cv);
  const std::string curves = ::testing::TempDir() + "/focus_output_curves.safetensors";
  save_block_curves(curves, cv, n);
  int64_t ctx = 0;
  const BlockMassCurves back = load_block_curves(curves, &ctx);
  EXPECT_EQ(back.metric, BlockMetric::Output);
  EXPECT_EQ(ctx, n);
  for (int64_t h = 0; h < c.heads; ++h)
    for (int64_t K = 0; K <= 6; ++K) EXPECT_NEAR(back.missed_at(0, h, K), cv.missed_at(0, h, K), 1e-5);

  BlockBudget b;
  b.block = 4;
  b.window = 5;
  b.k = allocate_block_budget(back, 2.0);
  b.metric = back.metric;
  const std::string file = ::testing::TempDir() + "/focus_output_budget.json";
  save_block_budget(file, b);
  EXPECT_EQ(load_block_budget(file).metric, BlockMetric::Output);
  b.metric = BlockMetric::Mass;
  save_block_budget(file, b);
  EXPECT_EQ(read_file(file).find("metric"), std::string::npos);  // as files were before the metric
  EXPECT_EQ(load_block_budget(file).metric, BlockMetric::Mass);
  std::ofstream(file) << R"({"format": "focus-block-budget", "block": 4, "window": 5, "sinks": 1,
      "k": [[1, 1, 1, 1]], "metric": "entropy"})";
  const std::string e = focus::test::error_of([&] { load_block_budget(file); });
  EXPECT_NE(e.find("unknown block metric 'entropy'"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_EQ(parse_block_metric("output", "x"), BlockMetric::Output);
}
