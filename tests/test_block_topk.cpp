// Block top-k attention (focus/block_topk.h): the policy against a brute-force computation of its
// definition, against dense attention when it reads every block, token by token against one call,
// causality, and its options.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "focus/block_topk.h"
#include "model/attention.h"
#include "test_models.h"
#include "test_util.h"

using namespace focus;
using focus::test::hidden_decoded;
using focus::test::hidden_of;
using focus::test::max_abs_diff;
using focus::test::random_model;
using focus::test::random_normal;
using focus::test::rows_call;
using focus::test::window_of;

namespace {

ModelConfig small_config() { return focus::test::one_global_layer_config(); }

// The definition, in double: the blocks row p of head h reads (empty when p - w < S); counts in
// *choices the rows with more candidate blocks than K. With blocks chosen every R rows, the row
// p0 = p - (p - w) % R chooses among the blocks before its own current block, and row p reads
// those, its own current block and every block between the two.
std::vector<int64_t> reference_blocks(const std::vector<float>& q, const std::vector<float>& k, const ModelConfig& c,
                                      const BlockTopKSettings& s, int64_t p, int64_t h, int64_t* choices) {
  const int64_t f = p - s.window, B = s.block, hd = c.head_dim, g = h / (c.heads / c.kv_heads);
  if (f < s.sinks) return {};
  const int64_t cur = f / B, f0 = f - f % s.select_every, p0 = f0 + s.window;
  std::vector<int64_t> blocks;
  for (int64_t b = f0 / B; b <= cur; ++b) blocks.push_back(b);
  if (f0 < s.sinks) return blocks;  // the tile's first row reads nothing far
  std::vector<std::pair<double, int64_t>> cand;
  for (int64_t b = 0; b < f0 / B; ++b) {
    if ((b + 1) * B - 1 < s.sinks) continue;  // sink keys only
    double bound = 0;
    for (int64_t d = 0; d < hd; ++d) {
      double mn = INFINITY, mx = -INFINITY;
      for (int64_t j = b * B; j < (b + 1) * B; ++j) {
        const double x = k[j * c.kv_dim() + g * hd + d];
        mn = std::min(mn, x);
        mx = std::max(mx, x);
      }
      const double qd = q[p0 * c.q_dim() + h * hd + d];
      bound += std::max(qd * mn, qd * mx);
    }
    cand.push_back({bound, b});
  }
  std::sort(cand.begin(), cand.end(),
            [](const auto& x, const auto& y) { return x.first > y.first || (x.first == y.first && x.second < y.second); });
  const int64_t K = s.k_of(h);
  if ((int64_t)cand.size() > K) ++*choices;
  for (int64_t i = 0; i < std::min<int64_t>(K, (int64_t)cand.size()); ++i) blocks.push_back(cand[i].second);
  return blocks;
}

// Softmax over the visible keys of every (row, head), in double; the far bias added to the scores
// of the visible keys beyond the window and the sinks.
std::vector<double> reference_attention(const std::vector<float>& q, const std::vector<float>& k,
                                        const std::vector<float>& v, const ModelConfig& c, const BlockTopKSettings& s,
                                        int64_t n, int64_t* choices) {
  const int64_t hd = c.head_dim, hpk = c.heads / c.kv_heads;
  std::vector<double> o(n * c.q_dim(), 0.0);
  for (int64_t p = 0; p < n; ++p)
    for (int64_t h = 0; h < c.heads; ++h) {
      const std::vector<int64_t> blocks = reference_blocks(q, k, c, s, p, h, choices);
      std::vector<double> sc(p + 1, -INFINITY);
      double mx = -INFINITY;
      for (int64_t j = 0; j <= p; ++j) {
        const bool vis = p - j < s.window || j < s.sinks ||
                         std::find(blocks.begin(), blocks.end(), j / s.block) != blocks.end();
        if (!vis) continue;
        double d = 0;
        for (int64_t y = 0; y < hd; ++y)
          d += (double)q[p * c.q_dim() + h * hd + y] * k[j * c.kv_dim() + (h / hpk) * hd + y];
        sc[j] = d * c.attn_scale + (p - j >= s.window && j >= s.sinks ? (double)s.far_bias : 0.0);
        mx = std::max(mx, sc[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j <= p; ++j) {
        if (sc[j] == -INFINITY) continue;
        const double e = std::exp(sc[j] - mx);
        sum += e;
        for (int64_t y = 0; y < hd; ++y) o[p * c.q_dim() + h * hd + y] += e * v[j * c.kv_dim() + (h / hpk) * hd + y];
      }
      for (int64_t y = 0; y < hd; ++y) o[p * c.q_dim() + h * hd + y] /= sum;
    }
  return o;
}

std::string error_of(const ModelConfig& c, const std::string& spec) {
  return focus::test::error_of([&] { make_attention_plan(c, spec); });
}

}  // namespace

// The policy's output equals the definition computed by brute force, over a prefill chunk, a
// one-row chunk (the gathered decoding path) and a longer chunk from the cache (the tiled path).
TEST(BlockTopK, MatchesBruteForceDefinition) {
  const ModelConfig c = small_config();
  const int64_t n = 90;
  auto q = random_normal(n * c.q_dim(), 1, 1.f);
  auto k = random_normal(n * c.kv_dim(), 2, 1.f);
  const auto v = random_normal(n * c.kv_dim(), 3, 1.f);
  auto settings = [](int64_t block, int64_t k, int64_t window, int64_t sinks, std::vector<int64_t> head_k = {},
                     int64_t every = 1, float far = 0.f) {
    BlockTopKSettings s;
    s.far_bias = far;
    s.select_every = every;
    s.block = block;
    s.k = head_k.empty() ? k : *std::max_element(head_k.begin(), head_k.end());
    s.window = window;
    s.sinks = sinks;
    s.head_k = head_k;
    return s;
  };
  // Then three where each head has its own K (per-head budgets), one head reading no chosen block;
  // the rest choose once every R rows: R dividing B, equal to it, a multiple of it, neither, with
  // sinks spanning blocks, and with per-head budgets.
  const std::vector<BlockTopKSettings> cases = {
      settings(4, 2, 5, 1),           settings(8, 1, 3, 0),           settings(5, 3, 10, 7),
      settings(1, 4, 2, 2),           settings(16, 0, 4, 1),          settings(3, 100, 6, 1),
      settings(7, 2, 1, 20),          settings(4, 0, 5, 1, {0, 3, 1, 2}), settings(1, 0, 2, 2, {5, 0, 0, 9}),
      settings(3, 0, 6, 1, {100, 2, 0, 1}),
      settings(4, 2, 5, 1, {}, 2),    settings(4, 2, 8, 1, {}, 4),    settings(2, 3, 5, 1, {}, 8),
      settings(5, 2, 10, 7, {}, 3),   settings(1, 4, 2, 2, {}, 16),   settings(3, 0, 6, 1, {100, 2, 0, 1}, 5),
      // A far bias (far=C) on every pair read beyond the window and the sinks.
      settings(4, 2, 5, 1, {}, 1, 0.7f), settings(3, 0, 6, 1, {100, 2, 0, 1}, 1, -1.3f),
      settings(5, 2, 10, 7, {}, 3, 2.f)};
  // Then again with queries and keys rounded to whole numbers: many blocks tie on their bound, and
  // the ties go to the lower block.
  for (int pass = 0; pass < 2; ++pass) {
  if (pass == 1) {
    for (float& x : q) x = std::round(x);
    for (float& x : k) x = std::round(x);
  }
  for (const BlockTopKSettings& s : cases) {
    std::string ks;
    for (int64_t x : s.head_k) ks.append(" ").append(std::to_string(x));
    SCOPED_TRACE("block " + std::to_string(s.block) + " k " + std::to_string(s.k) + " window " +
                 std::to_string(s.window) + " sinks " + std::to_string(s.sinks) + " head k" + ks + " every " +
                 std::to_string(s.select_every) + " far " + std::to_string(s.far_bias));
    const auto policy = block_topk_attention(s);
    int64_t choices = 0;
    const auto ref = reference_attention(q, k, v, c, s, n, &choices);
    if (s.k < 10) {
      EXPECT_GT(choices, 0) << "the bound really chooses";
    }
    // In chunks (the block-list tiles from position 0, then the gathered and grouped paths from the
    // cache), and all rows in one call (block-list tiles across several row tiles).
    for (const auto& calls : {std::vector<std::pair<int64_t, int64_t>>{{0, 37}, {37, 1}, {38, n - 38}},
                              std::vector<std::pair<int64_t, int64_t>>{{0, 13}, {13, 1}, {14, 1}, {15, 3}, {18, 1},
                                                                       {19, 2}, {21, n - 21}},
                              std::vector<std::pair<int64_t, int64_t>>{{0, n}}}) {
      std::unique_ptr<AttentionState> state;
      std::vector<float> out(n * c.q_dim(), 0.f);
      for (auto [pos0, T] : calls) {
        AttentionCall a = rows_call(c, q, k, pos0, T);
        a.v = v.data();
        a.out = out.data() + pos0 * c.q_dim();
        policy->attend(a, state, nullptr);
      }
      // Float scores and float accumulation of at most 90 probability-weighted O(1) values: errors
      // stay near 1e-6 of the output's scale.
      double err = 0;
      for (int64_t i = 0; i < n * c.q_dim(); ++i)
        err = std::max(err, std::fabs(out[i] - ref[i]) / (1 + std::fabs(ref[i])));
      EXPECT_LT(err, 1e-5) << calls.size() << " calls, pass " << pass;
    }
  }
  }
}

// block_bounds against Quest's bound in float64 from the keys themselves: for ranges that start
// and end inside vector tiles, whole runs of tiles and single blocks; on every kv head; and after a
// rollback into the middle of a block followed by other keys, where the bounds are those of a
// state that only ever saw the new keys.
TEST(BlockTopK, BoundsMatchFloat64) {
  const int64_t kvh_n = 2, hd = 12, kvd = kvh_n * hd, B = 2, n = 301;  // 150 complete blocks
  const auto q = random_normal(hd, 31, 1.f);
  const auto k = random_normal(n * kvd, 32, 1.f);
  auto reference = [&](const std::vector<float>& keys, int64_t kvh, int64_t b) {
    double bound = 0;
    for (int64_t d = 0; d < hd; ++d) {
      double mn = INFINITY, mx = -INFINITY;
      for (int64_t j = b * B; j < (b + 1) * B; ++j) {
        mn = std::min(mn, (double)keys[j * kvd + kvh * hd + d]);
        mx = std::max(mx, (double)keys[j * kvd + kvh * hd + d]);
      }
      bound += std::max((double)q[d] * mn, (double)q[d] * mx);
    }
    return bound;
  };
  auto check = [&](const BlockTopKState& st, const std::vector<float>& keys) {
    ASSERT_EQ(st.complete_blocks(), st.len() / B);
    for (int64_t kvh = 0; kvh < kvh_n; ++kvh)
      for (auto [b0, b1] : std::vector<std::pair<int64_t, int64_t>>{
               {0, st.complete_blocks()}, {3, 77}, {5, 6}, {st.complete_blocks() - 9, st.complete_blocks()}, {40, 40}}) {
        std::vector<float> out(std::max<int64_t>(1, b1 - b0), -7.f);
        block_bounds(q.data(), st, kvh, b0, b1, out.data());
        for (int64_t b = b0; b < b1; ++b) {
          ASSERT_NEAR(out[b - b0], reference(keys, kvh, b), 1e-5 * (1 + std::fabs(reference(keys, kvh, b))))
              << "kv head " << kvh << " block " << b << " of " << b0 << " .. " << b1;
        }
        if (b1 == b0) {
          EXPECT_EQ(out[0], -7.f);  // an empty range writes nothing
        }
      }
  };
  BlockTopKState st(B, kvh_n, hd);
  st.append(cpu::KvView(k.data()), kvd, 37);
  st.append(cpu::KvView(k.data()), kvd, n);
  check(st, k);
  // Several query heads at once give each head's bits of one at a time (a negative zero and a
  // NaN among the queries: both pick a side as one head alone does).
  auto qs = random_normal(5 * hd, 34, 1.f);
  qs[3] = -0.f;
  qs[hd + 5] = NAN;
  for (int64_t nh = 1; nh <= 5; ++nh)
    for (auto [b0, b1] : std::vector<std::pair<int64_t, int64_t>>{{0, st.complete_blocks()}, {3, 77}, {5, 6}}) {
      const int64_t stride = b1 - b0 + 3;
      std::vector<float> many(nh * stride, -7.f), one(b1 - b0);
      block_bounds(qs.data(), nh, st, 1, b0, b1, many.data(), stride);
      for (int64_t h = 0; h < nh; ++h) {
        block_bounds(qs.data() + h * hd, st, 1, b0, b1, one.data());
        for (int64_t b = 0; b < b1 - b0; ++b)
          ASSERT_EQ(std::memcmp(&many[h * stride + b], &one[b], sizeof(float)), 0)
              << nh << " heads, head " << h << ", block " << b0 + b;
        EXPECT_EQ(many[h * stride + b1 - b0], -7.f);  // nothing written past the range
      }
    }
  // Back to 121 keys (block 60 cut short), then other keys from there on.
  std::vector<float> k2 = k;
  const auto other = random_normal((n - 121) * kvd, 33, 3.f);
  std::copy(other.begin(), other.end(), k2.begin() + 121 * kvd);
  st.truncate(121);
  EXPECT_EQ(st.complete_blocks(), 60);
  st.append(cpu::KvView(k2.data()), kvd, n);
  check(st, k2);
  BlockTopKState fresh(B, kvh_n, hd);
  fresh.append(cpu::KvView(k2.data()), kvd, n);
  std::vector<float> a(fresh.complete_blocks()), b(fresh.complete_blocks());
  block_bounds(q.data(), st, 1, 0, st.complete_blocks(), a.data());
  block_bounds(q.data(), fresh, 1, 0, fresh.complete_blocks(), b.data());
  EXPECT_EQ(a, b);
  // Blocks not complete are refused.
  EXPECT_THROW(block_bounds(q.data(), st, 0, 0, st.complete_blocks() + 1, a.data()), focus::Error);
}

// The selection given the bounds (block_bounds' bits), against a full sort by block_ranks_before
// with NaN last, on bounds the bucket search cannot divide: all equal, spread over a range far
// below float's smallest normal (about 1e-43: the bucket scale overflows), with infinities, and with
// NaN. Each (row, head) must list the blocks the sort puts first, ascending.
TEST(BlockTopK, SelectsExactlyOnExtremeBounds) {
  ModelConfig c = small_config();  // 4 heads, 2 kv heads, head dim 8
  const int64_t n = 300, B = 2, hd = c.head_dim;
  BlockTopKSettings s;
  s.block = B;
  s.window = 4;
  s.sinks = 1;
  s.set_head_k({1, 5, 17, 40});
  for (int kind = 0; kind < 4; ++kind) {
    SCOPED_TRACE("kind " + std::to_string(kind));
    std::vector<float> q(n * c.q_dim(), 0.f), k(n * c.kv_dim(), 0.f);
    for (int64_t t = 0; t < n; ++t) q[t * c.q_dim()] = q[t * c.q_dim() + 2 * hd] = 1.f;  // each kv head's first query head
    for (int64_t t = 0; t < n; ++t) q[t * c.q_dim() + hd] = q[t * c.q_dim() + 3 * hd] = -1.f;
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < c.heads; ++h) q[t * c.q_dim() + h * hd + 1] = q[t * c.q_dim() + h * hd];
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < c.kv_heads; ++g) {
        float& x = k[j * c.kv_dim() + g * hd];
        if (kind == 0) x = 0.5f;                                  // every bound equal
        if (kind == 1) x = (float)((j * 7919) % 13) * 1e-44f;     // denormal spread, many ties
        if (kind == 2) x = (j % 9 == 0) ? INFINITY : (j % 11 == 0 ? -INFINITY : (float)(j % 5));
        if (kind == 3) {  // every seventh block: +inf in one dimension, -inf in the next: NaN bounds
          const bool bad = (j / B) % 7 == 0;
          x = bad ? INFINITY : (float)(j % 6) * 1e-3f;
          k[j * c.kv_dim() + g * hd + 1] = bad ? -INFINITY : 0.f;
        }
      }
    BlockTopKState st(B, c.kv_heads, hd);
    st.append(k.data(), c.kv_dim(), n);
    const AttentionCall a = rows_call(c, q, k, 0, n);
    std::vector<int32_t> qg;
    const int kq = block_topk_select(a, st, s, qg);
    int64_t checked = 0, nans = 0;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t f = t - s.window;
      if (f < s.sinks) continue;
      const int64_t cur = f / B, lo = s.sinks / B, nb = cur - lo;
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t Kh = std::min(s.k_of(h), (int64_t)kq - 1);
        if (nb <= Kh) continue;
        std::vector<float> bd(nb);
        block_bounds(q.data() + t * c.q_dim() + h * hd, st, h / 2, lo, cur, bd.data());
        if (kind == 3) nans += std::count_if(bd.begin(), bd.end(), [](float x) { return std::isnan(x); });
        std::vector<std::pair<float, int32_t>> cand;
        for (int64_t x = 0; x < nb; ++x)
          cand.push_back({std::isnan(bd[x]) ? -INFINITY : bd[x], (int32_t)(lo + x)});
        std::sort(cand.begin(), cand.end(), block_ranks_before);
        std::vector<int32_t> want;
        for (int64_t i = 0; i < Kh; ++i) want.push_back(cand[i].second);
        std::sort(want.begin(), want.end());
        const int32_t* slots = qg.data() + (t * c.heads + h) * kq;
        ASSERT_EQ(slots[0], cur);
        ASSERT_EQ(std::vector<int32_t>(slots + 1, slots + 1 + Kh), want) << "row " << t << " head " << h;
        ++checked;
      }
    }
    EXPECT_GT(checked, 500);
    if (kind == 3) {
      EXPECT_GT(nans, 1000) << "NaN bounds to rank";
    }
  }
}

// The listing rule on its own, against a sort of (bound, block) pairs: random bounds, whole numbers
// (ties), NaN and infinities, every bound equal, and rows whose evenly spaced sample holds the
// largest bounds (so the sample's pivot keeps fewer than Kh and every bound is taken).
TEST(BlockTopK, PickMatchesSorting) {
  std::mt19937 g(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> scratch;
  int64_t checked = 0;
  for (int kind = 0; kind < 5; ++kind)
    for (int64_t nb : {2, 7, 100, 130, 200, 257, 600, 2048, 5000})
      for (int64_t Kh : {int64_t{1}, int64_t{3}, nb / 10, nb / 2, nb - 1}) {
        if (Kh < 1 || Kh >= nb) continue;
        SCOPED_TRACE("kind " + std::to_string(kind) + " nb " + std::to_string(nb) + " Kh " + std::to_string(Kh));
        std::vector<float> bd(nb);
        for (int64_t x = 0; x < nb; ++x) {
          const float r = nd(g);
          if (kind == 0) bd[x] = r;
          if (kind == 1) bd[x] = std::round(r * 2.f);
          if (kind == 2) bd[x] = x % 13 == 0 ? NAN : x % 17 == 0 ? INFINITY : x % 19 == 0 ? -INFINITY : std::round(r);
          if (kind == 3) bd[x] = 1.5f;
          if (kind == 4) bd[x] = r;
        }
        if (kind == 4)  // the sampled positions hold the largest bounds
          for (int64_t i = 0; i < 64; ++i) bd[i * nb / 64] = 100.f + (float)i;
        std::vector<std::pair<float, int32_t>> cand;
        for (int64_t x = 0; x < nb; ++x) cand.push_back({std::isnan(bd[x]) ? -INFINITY : bd[x], (int32_t)(40 + x)});
        std::sort(cand.begin(), cand.end(), block_ranks_before);
        std::vector<int32_t> want;
        for (int64_t i = 0; i < Kh; ++i) want.push_back(cand[i].second);
        std::sort(want.begin(), want.end());
        std::vector<int32_t> slots(Kh + 1, -7);
        block_topk_pick(bd.data(), nb, Kh, 40, slots.data(), scratch);
        EXPECT_EQ(slots[0], -7) << "slot 0 is the caller's";
        ASSERT_EQ(std::vector<int32_t>(slots.begin() + 1, slots.end()), want);
        ++checked;
      }
  EXPECT_GT(checked, 100);
}

// A call of a few rows (decoding: the threads share each row's blocks, cut into pieces) lists
// the same blocks for each row as one call over every row (the threads share the rows), ties
// included, with 1 and 3 threads.
TEST(BlockTopK, FewRowsChooseAsOneCall) {
  ModelConfig c = small_config();
  c.head_dim = 64;  // enough work per row for the threads to share it
  const int64_t n = 2400, hd = c.head_dim;
  BlockTopKSettings s;
  s.block = 2;
  s.window = 8;
  s.sinks = 3;
  s.set_head_k({3, 40, 0, 700});  // 700: more than one piece of blocks to choose from
  const int saved = focus::num_threads();
  for (int pass = 0; pass < 2; ++pass) {
    auto q = random_normal(n * c.q_dim(), 11 + pass, 1.f);
    auto k = random_normal(n * c.kv_dim(), 12 + pass, 1.f);
    if (pass == 1) {  // whole numbers: many bounds tie
      for (float& x : q) x = std::round(x);
      for (float& x : k) x = std::round(x);
    }
    BlockTopKState st(s.block, c.kv_heads, hd);
    st.append(k.data(), c.kv_dim(), n);
    auto lists = [&](int64_t pos0, int64_t T) {  // the used slots of every (row, head)
      const AttentionCall a = rows_call(c, q, k, pos0, T);
      std::vector<int32_t> qg;
      const int kq = block_topk_select(a, st, s, qg);
      std::vector<std::vector<int32_t>> out(T * c.heads);
      for (int64_t i = 0; i < T * c.heads; ++i)
        for (int x = 0; x < kq; ++x)
          if (qg[i * kq + x] >= 0) out[i].push_back(qg[i * kq + x]);
      return out;
    };
    focus::set_threads(2);
    const auto all = lists(0, n);
    for (int threads : {1, 3}) {
      focus::set_threads(threads);
      for (auto [pos0, T] : std::vector<std::pair<int64_t, int64_t>>{{n - 1, 1}, {n - 4, 4}, {1500, 2}, {700, 3},
                                                                      {10, 1}, {11, 4}, {0, 1}}) {
        SCOPED_TRACE("pass " + std::to_string(pass) + ", " + std::to_string(threads) + " threads, rows " +
                     std::to_string(pos0) + " + " + std::to_string(T));
        const auto few = lists(pos0, T);
        for (int64_t i = 0; i < T * c.heads; ++i)
          ASSERT_EQ(few[i], all[pos0 * c.heads + i]) << "row " << pos0 + i / c.heads << " head " << i % c.heads;
      }
    }
    EXPECT_EQ(all[(n - 1) * c.heads + 3].size(), 701u) << "the last row's fourth head chooses 700 blocks";
  }
  focus::set_threads(saved);
}

// K large enough to read every block: dense causal attention, at density one.
TEST(BlockTopK, ReadingEveryBlockIsDense) {
  for (Arch arch : {Arch::Llama, Arch::GPT2, Arch::Gemma3}) {
    auto m = random_model(arch, 21);
    const std::vector<int32_t> ids = window_of(60, m->cfg.vocab, 9).ids;
    const AttentionPlan plan = make_attention_plan(m->cfg, "blocktopk:block=4,k=100,window=3,sinks=1");
    AttentionStats st;
    const auto a = hidden_of(*m, ids, &plan, &st);
    EXPECT_LT(max_abs_diff(a, hidden_of(*m, ids, nullptr)), 1e-4);
    EXPECT_GT(st.layers, 0);
    EXPECT_NEAR(st.density(), 1.0, 1e-12);
  }
}

// A sparse pattern: token by token from the cache (with a rollback into the middle of a block in
// between) equals one call, the index grows once per new block instead of being rebuilt, and a
// prefix alone equals the first rows of the full run (causality).
TEST(BlockTopK, DecodesLikePrefillAndIsCausal) {
  auto m = random_model(Arch::Llama, 22);
  const int64_t n = 60, D = m->cfg.dim, B = 4;
  const std::vector<int32_t> ids = window_of(n, m->cfg.vocab, 10).ids;
  // Each row choosing, then the blocks chosen once every 3 rows (the rollback lands inside a tile).
  for (const char* spec : {"blocktopk:block=4,k=2,window=6,sinks=1", "blocktopk:block=4,k=2,window=6,sinks=1,every=3"}) {
  SCOPED_TRACE(spec);
  const AttentionPlan plan = make_attention_plan(m->cfg, spec);
  AttentionStats st;
  const auto full = hidden_of(*m, ids, &plan, &st);
  EXPECT_LT(st.density(), 0.8);
  EXPECT_GT(max_abs_diff(full, hidden_of(*m, ids, nullptr)), 1e-3);  // the pattern really is sparse

  KVCache c;
  c.init(m->cfg, n);
  std::vector<float> h(n * D);
  forward(*m, ids.data(), 30, c, h.data(), &plan);
  c.truncate(22);
  for (int64_t i = 22; i < n; ++i) forward(*m, ids.data() + i, 1, c, h.data() + i * D, &plan);
  EXPECT_LT(max_abs_diff(h, full), 1e-5);
  for (int64_t l = 0; l < m->cfg.layers; ++l) {
    const auto* bs = dynamic_cast<const BlockTopKState*>(c.state[l].get());
    ASSERT_NE(bs, nullptr);
    EXPECT_EQ(bs->len(), n);
    EXPECT_EQ(bs->complete_blocks(), n / B);
    EXPECT_EQ(bs->index.n_groups, n / B);
    // One grow for the prefill, then one per block the decoding reached beyond it.
    EXPECT_EQ(bs->index_grows, 1 + (n + B - 1) / B - (30 + B - 1) / B);
  }

  // Chunked prefill from the cache, too.
  KVCache c2;
  c2.init(m->cfg, n);
  std::vector<float> h2(n * D);
  forward(*m, ids.data(), 25, c2, h2.data(), &plan);
  forward(*m, ids.data() + 25, n - 25, c2, h2.data() + 25 * D, &plan);
  EXPECT_LT(max_abs_diff(h2, full), 1e-5);

  const std::vector<int32_t> prefix(ids.begin(), ids.begin() + 40);
  EXPECT_LT(max_abs_diff(hidden_of(*m, prefix, &plan), full, 0, 40 * D), 1e-5);

  // A rollback followed by other tokens: the choices of tiles that began after the rollback point
  // go with it (kept ones would be the old tokens'), so decoding equals one call over the new text.
  std::vector<int32_t> other = ids;
  for (int64_t i = 22; i < n; ++i) other[i] = (ids[i] + 7) % m->cfg.vocab;
  const auto h3 = hidden_decoded(*m, other, &plan, 40, 22, focus::cpu::KvType::F32, &ids);
  EXPECT_LT(max_abs_diff(h3, hidden_of(*m, other, &plan), 22 * D, n * D), 1e-5);
  }
}

// Growing an index keeps every member list, under each routing head.
TEST(BlockTopK, KeyIndexGrowsInPlace) {
  cpu::GroupedKeyIndex idx;
  idx.reset(2, 2);
  const std::vector<int32_t> kg = {0, 1, 1, 0, 1, 0, 0, 1};  // [RH = 2, 4 keys]
  idx.append(kg.data(), 4);
  idx.grow(5);
  EXPECT_EQ(idx.n_groups, 5);
  EXPECT_EQ(idx.group(0, 0), (std::vector<int32_t>{0, 3}));
  EXPECT_EQ(idx.group(0, 1), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(idx.group(1, 0), (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(idx.group(1, 1), (std::vector<int32_t>{0, 3}));
  const std::vector<int32_t> more = {4, 4};
  idx.append(more.data(), 1);
  EXPECT_EQ(idx.group(1, 4), (std::vector<int32_t>{4}));
  EXPECT_THROW(idx.grow(3), Error);
}

// Options: the defaults, and an unknown option or a bad value is an error naming it.
TEST(BlockTopK, OptionsAreCheckedByName) {
  const ModelConfig c = small_config();
  const auto names = registered_attention_policies();
  EXPECT_NE(std::find(names.begin(), names.end(), "blocktopk"), names.end());
  EXPECT_EQ(make_attention_plan(c, "blocktopk").at(0).name(), "blocktopk");
  const BlockTopKSettings d = block_topk_settings(AttentionOptions::parse("", "blocktopk"), c, 0);
  EXPECT_EQ(d.block, 64);
  EXPECT_EQ(d.k, 8);
  EXPECT_EQ(d.window, 256);
  EXPECT_EQ(d.sinks, 1);
  const BlockTopKSettings s = block_topk_settings(
      AttentionOptions::parse("block=32,k=0,window=1,sinks=0", "blocktopk:block=32,k=0,window=1,sinks=0"), c, 0);
  EXPECT_EQ(s.block, 32);
  EXPECT_EQ(s.k, 0);
  EXPECT_EQ(s.window, 1);
  EXPECT_EQ(s.sinks, 0);
  EXPECT_EQ(d.far_bias, 0.f);
  EXPECT_EQ(block_topk_settings(AttentionOptions::parse("far=-0.5", "blocktopk:far=-0.5"), c, 0).far_bias, -0.5f);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"blocktopk:far=1000", "far"},
      {"blocktopk:blocks=64", "blocks"}, {"blocktopk:block=0", "block must"},    {"blocktopk:k=-1", "k must"},
      {"blocktopk:window=0", "window must"},  {"blocktopk:sinks=-1", "sinks must"},  {"blocktopk:k=x", "k must be an integer"},
      {"blocktopk:block=64,topk=8", "topk"}};
  for (const auto& [spec, word] : bad) {
    const std::string e = error_of(c, spec);
    EXPECT_NE(e.find(word), std::string::npos) << spec << ": '" << e << "'";
  }
}
