// Hard-mode Focus attention: the fused and two-call kernels against the masked reference, the
// degenerate patterns against dense causal attention, the pair count against brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "eval/bench_attention.h"
#include "focus/focus_cache.h"
#include "focus/group_layout.h"
#include "test_util.h"
#include "kernels/cpu/soft_attention.h"
#include "kernels/cpu/cached_attention.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/attention.h"

using focus::cpu::AttnShape;
using focus::Routing;

namespace {

struct Inputs {
  AttnShape s;
  std::vector<float> q, k, v;
};

Inputs make_inputs(int64_t n, int64_t heads, int64_t kv_heads, int64_t hd, int64_t window, int64_t sinks,
                   uint32_t seed, int64_t pad = 0) {
  Inputs in;
  AttnShape& s = in.s;
  s.n_q = s.n_kv = n;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.head_dim = hd;
  s.q_stride = heads * hd + pad;
  s.kv_stride = kv_heads * hd + pad;
  s.o_stride = heads * hd + pad;
  s.scale = 1.f / std::sqrt((float)hd);
  s.local_window = window;
  s.sinks = sinks;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  in.q.resize(std::max<int64_t>(1, n * s.q_stride));
  in.k.resize(std::max<int64_t>(1, n * s.kv_stride));
  in.v.resize(std::max<int64_t>(1, n * s.kv_stride));
  for (auto& x : in.q) x = nd(rng);
  for (auto& x : in.k) x = nd(rng);
  for (auto& x : in.v) x = nd(rng);
  return in;
}

// Random routing over groups [0, G - 2); token n / 2 also alone in group G - 2 (a single-member
// group); group G - 1 stays empty.
std::vector<int32_t> make_routing(int64_t n, int topk, int64_t G, uint32_t seed) {
  std::mt19937 rng(seed);
  const int64_t used = G - 2;
  std::vector<int32_t> ids(n * topk);
  for (int64_t i = 0; i < n; ++i) {
    int32_t a = (int32_t)(rng() % used);
    if (topk == 1) {
      ids[i] = i == n / 2 ? (int32_t)(G - 2) : a;
    } else {
      int32_t b = (int32_t)(rng() % (used - 1));
      if (b >= a) ++b;
      if (i == n / 2) b = (int32_t)(G - 2);
      ids[2 * i] = std::min(a, b);
      ids[2 * i + 1] = std::max(a, b);
    }
  }
  return ids;
}

struct Out {
  std::vector<float> o, lse;
};

template <class F>
Out run(F f, const Inputs& in) {
  Out r;
  r.o.assign(std::max<int64_t>(1, in.s.n_q * in.s.o_stride), 0.f);
  r.lse.assign(std::max<int64_t>(1, in.s.heads * in.s.n_q), 0.f);
  f(in.q.data(), in.k.data(), in.v.data(), r.o.data(), r.lse.data());
  return r;
}

// Largest |a - b| / max(1, |b|) over outputs (only the head_dim * heads floats of each row) and lse.
double rel_err(const Out& a, const Out& b, const AttnShape& s) {
  double e = 0;
  for (int64_t i = 0; i < s.n_q; ++i)
    for (int64_t x = 0; x < s.heads * s.head_dim; ++x) {
      const double u = a.o[i * s.o_stride + x], w = b.o[i * s.o_stride + x];
      e = std::max(e, std::fabs(u - w) / std::max(1.0, std::fabs(w)));
    }
  for (int64_t i = 0; i < s.heads * s.n_q; ++i) {
    const double u = a.lse[i], w = b.lse[i];
    if (std::isinf(w) || std::isinf(u)) {
      if (u != w) e = INFINITY;
      continue;
    }
    e = std::max(e, std::fabs(u - w) / std::max(1.0, std::fabs(w)));
  }
  return std::isnan(e) ? INFINITY : e;
}

void check_against_reference(int64_t n, int64_t window, int topk, int64_t kv_heads, int64_t sinks,
                             int64_t heads = 8, int64_t hd = 64, int64_t pad = 0) {
  const int64_t G = 7;
  const uint32_t seed = (uint32_t)(n * 131 + window * 17 + topk * 7 + kv_heads * 3 + sinks + hd);
  const Inputs in = make_inputs(n, heads, kv_heads, hd, window, sinks, seed, pad);
  const std::vector<int32_t> ids = make_routing(n, topk, G, seed + 1);
  const Routing r{ids.data(), G, topk};
  const AttnShape& s = in.s;
  const Out ref = run([&](auto... p) { focus::cpu::focus_attention_reference(p..., s, r); }, in);
  const Out fused = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., s, r); }, in);
  const Out two = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., s, r); }, in);
  const std::string what = "n " + std::to_string(n) + " w " + std::to_string(window) + " k " +
                           std::to_string(topk) + " kv_heads " + std::to_string(kv_heads) + " sinks " +
                           std::to_string(sinks) + " hd " + std::to_string(hd);
  EXPECT_LE(rel_err(fused, ref, s), 1e-5) << "fused, " << what;
  EXPECT_LE(rel_err(two, ref, s), 1e-5) << "two-call, " << what;
}

// Dense causal attention from the flash kernel (window 0) on the same inputs.
Out dense_causal(const Inputs& in) {
  const AttnShape& s = in.s;
  focus::cpu::AttnShape d{s.n_q, s.n_q, 0, s.heads, s.kv_heads, s.head_dim, s.q_stride, s.kv_stride, s.o_stride,
                          s.scale, 0};
  return run([&](auto... p) { focus::cpu::flash_attention(p..., d); }, in);
}

void check_equals_dense(const Inputs& in, const Routing& r, const char* what) {
  const Out dense = dense_causal(in);
  const Out fused = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., in.s, r); }, in);
  const Out two = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., in.s, r); }, in);
  const std::string at = std::string(what) + ", n " + std::to_string(in.s.n_q) + " w " + std::to_string(in.s.local_window);
  EXPECT_LE(rel_err(fused, dense, in.s), 1e-5) << "fused, " << at;
  EXPECT_LE(rel_err(two, dense, in.s), 1e-5) << "two-call, " << at;
}

int64_t brute_pair_count(const Routing& r, int64_t n, int64_t w, int64_t S) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) {
      bool share = false;
      for (int a = 0; a < r.topk; ++a)
        for (int b = 0; b < r.topk; ++b) share |= r.ids[i * r.topk + a] == r.ids[j * r.topk + b];
      c += (i - j < w || j < S || share) ? 1 : 0;
    }
  return c;
}

}  // namespace

TEST(GroupLayout, StableSortedSegments) {
  const std::vector<int32_t> ids = {2, 0, 2, 1, 0, 2};
  const focus::GroupLayout L = focus::build_group_layout({ids.data(), 4, 1}, 6);
  EXPECT_EQ(L.offsets, (std::vector<int64_t>{0, 2, 3, 6, 6}));
  EXPECT_EQ(L.members, (std::vector<int32_t>{1, 4, 3, 0, 2, 5}));
  const std::vector<int32_t> ids2 = {0, 1, 1, 2, 0, 2};  // topk 2: each token in both its groups
  const focus::GroupLayout L2 = focus::build_group_layout({ids2.data(), 3, 2}, 3);
  EXPECT_EQ(L2.offsets, (std::vector<int64_t>{0, 2, 4, 6}));
  EXPECT_EQ(L2.members, (std::vector<int32_t>{0, 2, 0, 1, 1, 2}));
}

TEST(GroupLayout, RejectsBadRouting) {
  const std::vector<int32_t> out_of_range = {0, 3};
  EXPECT_THROW(focus::build_group_layout({out_of_range.data(), 3, 1}, 2), focus::Error);
  const std::vector<int32_t> unsorted = {1, 0};
  EXPECT_THROW(focus::build_group_layout({unsorted.data(), 3, 2}, 1), focus::Error);
  const std::vector<int32_t> repeated = {1, 1};
  EXPECT_THROW(focus::build_group_layout({repeated.data(), 3, 2}, 1), focus::Error);
  EXPECT_THROW(focus::build_group_layout({repeated.data(), 3, 3}, 0), focus::Error);  // topk 3
}

TEST(FocusPairCount, MatchesBruteForce) {
  for (int topk : {1, 2})
    for (int64_t n : {1, 5, 64, 300})
      for (int64_t w : {1, 3, 40, 400})
        for (int64_t S : {0, 2, 7}) {
          const std::vector<int32_t> ids = make_routing(n, topk, 6, (uint32_t)(n + w + S + topk));
          const Routing r{ids.data(), 6, topk};
          EXPECT_EQ(focus::cpu::focus_pair_count(r, n, w, S), brute_pair_count(r, n, w, S))
              << "topk " << topk << " n " << n << " w " << w << " S " << S;
        }
}

TEST(FocusAttention, SmallShapesMatchReference) {
  for (int64_t n : {1, 7, 63, 64, 65})
    for (int64_t w : {1, 16, 128})
      for (int topk : {1, 2})
        for (int64_t kvh : {8, 2, 1})
          for (int64_t S : {0, 4}) check_against_reference(n, w, topk, kvh, S);
}

TEST(FocusAttention, N1000MatchesReference) {
  if (focus::test::small_shapes()) {
    // Sanitized (30x slower): every window, topk, head layout and sink count once.
    check_against_reference(1000, 1, 1, 8, 0);
    check_against_reference(1000, 16, 2, 2, 4);
    check_against_reference(1000, 128, 2, 1, 4);
    return;
  }
  for (int64_t w : {1, 16, 128})
    for (int topk : {1, 2})
      for (int64_t kvh : {8, 2, 1})
        for (int64_t S : {0, 4}) check_against_reference(1000, w, topk, kvh, S);
}

TEST(FocusAttention, N3001MatchesReference) {
  if (focus::test::small_shapes()) {
    // Sanitized: one odd length with many tiles, grouped heads and sinks.
    check_against_reference(1501, 16, 2, 2, 4);
    return;
  }
  // Every window, topk, head layout and sink count appears at least once.
  check_against_reference(3001, 1, 1, 8, 0);
  check_against_reference(3001, 16, 2, 2, 4);
  check_against_reference(3001, 128, 1, 1, 4);
  check_against_reference(3001, 128, 2, 8, 0);
  check_against_reference(3001, 16, 1, 2, 0);
  check_against_reference(3001, 1, 2, 1, 4);
}

TEST(FocusAttention, ScratchIsKeptThenTrimmed) {
  // The kernels keep their buffers between calls; trimming frees them and the next call, which
  // allocates afresh, gives the same bits.
  const Inputs in = make_inputs(2000, 4, 2, 64, 32, 1, 5);
  const std::vector<int32_t> ids = make_routing(2000, 2, 7, 6);
  const Routing r{ids.data(), 7, 2};
  focus::cpu::focus_attention_trim_scratch(0);
  EXPECT_EQ(focus::cpu::focus_attention_scratch_bytes(), 0u);
  const Out a = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., in.s, r); }, in);
  const Out t = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., in.s, r); }, in);
  const size_t held = focus::cpu::focus_attention_scratch_bytes();
  EXPECT_GE(held, 2 * 2000 * 64 * sizeof(float)) << "key and value tiles of 2000 tokens";
  focus::cpu::focus_attention_trim_scratch(held);  // within the limit: kept
  EXPECT_EQ(focus::cpu::focus_attention_scratch_bytes(), held);
  focus::cpu::focus_attention_trim_scratch(held - 1);
  EXPECT_EQ(focus::cpu::focus_attention_scratch_bytes(), 0u);
  const Out b = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., in.s, r); }, in);
  const Out t2 = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., in.s, r); }, in);
  EXPECT_EQ(a.o, b.o);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(t.o, t2.o);
  EXPECT_EQ(t.lse, t2.lse);
}

TEST(FocusAttention, OddHeadDimsAndStrides) {
  for (int64_t hd : {8, 80})
    for (int topk : {1, 2}) check_against_reference(300, 16, topk, 2, 3, 4, hd, /*pad=*/5);
  check_against_reference(200, 70, 1, 1, 100, 2, 24, 3);  // many sinks, beyond one key tile
}

TEST(FocusAttention, OneGroupIsDenseCausal) {
  for (int64_t n : {65, 1000})
    for (int64_t w : {1, 16, 128})
      for (int64_t S : {0, 4}) {
        const Inputs in = make_inputs(n, 8, 2, 64, w, S, (uint32_t)(n + w + S));
        const std::vector<int32_t> ids(n, 0);
        check_equals_dense(in, {ids.data(), 1, 1}, "G = 1");
        // topk 2 over two groups: every pair shares both groups and must count once.
        std::vector<int32_t> both(2 * n);
        for (int64_t i = 0; i < n; ++i) both[2 * i] = 0, both[2 * i + 1] = 1;
        check_equals_dense(in, {both.data(), 2, 2}, "topk 2 of G = 2");
      }
}

TEST(FocusAttention, WindowCoveringEverythingIsDenseCausal) {
  for (int64_t n : {64, 1000})
    for (int topk : {1, 2})
      for (int64_t extra : {0, 7}) {
        const Inputs in = make_inputs(n, 8, 8, 64, n + extra, 4, (uint32_t)(n + topk + extra));
        const std::vector<int32_t> ids = make_routing(n, topk, 7, 5);
        check_equals_dense(in, {ids.data(), 7, topk}, "window >= n");
      }
}

TEST(FocusAttention, Causal) {
  // Changing key/value rows after position t must leave outputs at positions <= t unchanged.
  const int64_t n = 500, t = 311;
  for (int topk : {1, 2}) {
    Inputs in = make_inputs(n, 4, 2, 32, 16, 2, 99);
    const std::vector<int32_t> ids = make_routing(n, topk, 7, 3);
    const Routing r{ids.data(), 7, topk};
    const Out f0 = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., in.s, r); }, in);
    const Out c0 = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., in.s, r); }, in);
    for (int64_t i = (t + 1) * in.s.kv_stride; i < n * in.s.kv_stride; ++i) in.k[i] += 3.f, in.v[i] -= 2.f;
    const Out f1 = run([&](auto... p) { focus::cpu::focus_attention_fused(p..., in.s, r); }, in);
    const Out c1 = run([&](auto... p) { focus::cpu::focus_attention_two_call(p..., in.s, r); }, in);
    for (int64_t i = 0; i < (t + 1) * in.s.o_stride; ++i) {
      ASSERT_EQ(f0.o[i], f1.o[i]) << "fused, topk " << topk;
      ASSERT_EQ(c0.o[i], c1.o[i]) << "two-call, topk " << topk;
    }
  }
}

TEST(FocusAttention, GroupCallLeavesEmptyRowsAtMinusInfinity) {
  // Call 2 alone: the first token of every group has no same-group key beyond the window.
  const Inputs in = make_inputs(100, 2, 1, 16, 8, 0, 4);
  const std::vector<int32_t> ids = make_routing(100, 1, 7, 8);
  const Routing r{ids.data(), 7, 1};
  const Out o2 = run([&](auto... p) { focus::cpu::focus_group_attention(p..., in.s, r); }, in);
  for (int64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(o2.lse[i], -INFINITY);
    for (int64_t x = 0; x < in.s.heads * in.s.head_dim; ++x) EXPECT_EQ(o2.o[i * in.s.o_stride + x], 0.f);
  }
}

TEST(FocusAttention, MergeHandlesEmptyStates) {
  const float inf = INFINITY;
  std::vector<float> o = {1, 2, 3, 4, 5, 6}, lse = {-inf, 0.f, -inf};
  const std::vector<float> o2 = {7, 8, 9, 10, 11, 12}, lse2 = {-inf, -inf, std::log(3.f)};
  focus::cpu::merge_attention_states(o.data(), lse.data(), 2, o2.data(), lse2.data(), 2, 3, 1, 2);
  EXPECT_EQ(o[0], 0.f);
  EXPECT_EQ(o[1], 0.f);
  EXPECT_EQ(lse[0], -inf);
  EXPECT_FLOAT_EQ(o[2], 3.f);
  EXPECT_FLOAT_EQ(o[3], 4.f);
  EXPECT_FLOAT_EQ(lse[1], 0.f);
  EXPECT_FLOAT_EQ(o[4], 11.f);
  EXPECT_FLOAT_EQ(o[5], 12.f);
  EXPECT_FLOAT_EQ(lse[2], std::log(3.f));
}

TEST(FocusAttention, RejectsBadShapes) {
  Inputs in = make_inputs(10, 4, 3, 8, 4, 0, 1);
  const std::vector<int32_t> ids(10, 0);
  const Routing r{ids.data(), 1, 1};
  std::vector<float> o(10 * 32);
  EXPECT_THROW(focus::cpu::focus_attention_fused(in.q.data(), in.k.data(), in.v.data(), o.data(), nullptr, in.s, r),
               focus::Error);  // 4 heads over 3 kv heads
  in.s.kv_heads = 2;
  in.s.local_window = 0;
  EXPECT_THROW(focus::cpu::focus_attention_two_call(in.q.data(), in.k.data(), in.v.data(), o.data(), nullptr, in.s, r),
               focus::Error);
}

// The benchmark's JSON carries the keys the docs quote, with errors against the reference that
// are small, and null for what was not run (dense-t skipped, dense skipped).
// Decoding and chunked prefill over a cache indexed by group: rows run as a first chunk, a
// second chunk and then one at a time equal one call over the whole sequence: the masked
// reference (hard), the biased soft kernel (soft) and the window call (window). Keys and values
// past the rows being run are NaN, so reading one would show. The cache is truncated and
// refilled first, as a prefix reuse does.
TEST(FocusCachedAttention, DecodeAndChunksEqualOneCall) {
  const int64_t n = 301, window = 16, heads = 4, G = 7;
  for (int topk : {1, 2})
    for (int64_t kv_heads : {4, 2, 1})
      for (int64_t sinks : {0, 2}) {
        const int64_t hd = topk == 1 ? 20 : 16;  // a head dim with a scalar tail, and one of whole vectors
        const uint32_t seed = (uint32_t)(topk * 31 + kv_heads * 7 + sinks);
        const Inputs in = make_inputs(n, heads, kv_heads, hd, window, sinks, seed);
        const AttnShape& s = in.s;
        const std::vector<int32_t> ids = make_routing(n, topk, G, seed + 1);
        const Routing r{ids.data(), G, topk};
        std::mt19937 rng(seed + 2);
        std::normal_distribution<float> nd(0.f, 2.f);
        std::vector<float> p(n * G);
        for (int64_t i = 0; i < n; ++i) {
          double z = 0;
          for (int64_t g = 0; g < G; ++g) z += p[i * G + g] = std::exp(nd(rng));
          for (int64_t g = 0; g < G; ++g) p[i * G + g] = (float)(p[i * G + g] / z);
        }
        focus::FocusLayerCache fc, fresh;
        fresh.reset(G, topk);
        fresh.append(ids.data(), p.data(), n);
        fc.reset(G, topk);
        fc.append(ids.data(), p.data(), 200);
        fc.truncate(120);
        fc.append(ids.data() + 120 * topk, p.data() + 120 * G, n - 120);
        ASSERT_EQ(fc.members, fresh.members);
        ASSERT_EQ(fc.top, fresh.top);

        AttnShape ss = s;
        ss.groups = G;
        ss.eps = 1e-6f;
        const Out ref_hard = run([&](auto... a) { focus::cpu::focus_attention_reference(a..., s, r); }, in);
        const Out ref_soft = run(
            [&](const float* q, const float* k, const float* v, float* o, float* lse) {
              focus::cpu::soft_attention_forward(q, k, v, p.data(), o, lse, ss);
            },
            in);
        const Out ref_win = run([&](auto... a) { focus::cpu::focus_window_attention(a..., s); }, in);
        const std::vector<int32_t> one_group(n * topk, 0);  // everyone in group 0: dense causal
        const Routing dense_routing{one_group.data(), G, 1};
        const Out ref_dense = run([&](auto... a) { focus::cpu::focus_attention_reference(a..., s, dense_routing); }, in);
        for (auto [mode_b, ref] : {std::pair{focus::FocusMode::Hard, &ref_hard}, std::pair{focus::FocusMode::Soft, &ref_soft},
                                   std::pair{focus::FocusMode::Window, &ref_win}, std::pair{focus::FocusMode::Off, &ref_dense}}) {
          const focus::FocusMode mode = mode_b;  // a lambda below uses it (clang 14 cannot capture a binding)
          Out got;
          got.o.assign(n * s.o_stride, 0.f);
          got.lse = ref->lse;  // the cached path makes no lse
          int64_t pairs = 0;
          std::vector<float> k(in.k.size()), v(in.v.size());
          auto step = [&](int64_t pos0, int64_t t) {
            const int64_t end = (pos0 + t) * s.kv_stride;
            std::copy(in.k.begin(), in.k.begin() + end, k.begin());
            std::copy(in.v.begin(), in.v.begin() + end, v.begin());
            std::fill(k.begin() + end, k.end(), NAN);
            std::fill(v.begin() + end, v.end(), NAN);
            pairs += focus::cpu::focus_cached_attention(in.q.data() + pos0 * s.q_stride, k.data(), v.data(),
                                                   got.o.data() + pos0 * s.o_stride, s, pos0, t, mode, fc);
          };
          step(0, 100);
          step(100, 37);
          for (int64_t i = 137; i < n; ++i) step(i, 1);
          const std::string what = focus::to_string(mode) + " k " + std::to_string(topk) + " kv_heads " +
                                   std::to_string(kv_heads) + " sinks " + std::to_string(sinks) +
                                   " head dim " + std::to_string(hd);
          EXPECT_LE(rel_err(got, *ref, s), 1e-5) << what;
          if (mode == focus::FocusMode::Hard) {
            EXPECT_EQ(pairs, focus::cpu::focus_pair_count(r, n, window, sinks)) << what;
          }
          if (mode == focus::FocusMode::Soft || mode == focus::FocusMode::Off) {
            EXPECT_EQ(pairs, n * (n + 1) / 2) << what;
          }
        }
      }
}

TEST(FocusCachedAttention, RejectsMissingRouting) {
  const Inputs in = make_inputs(40, 2, 1, 8, 4, 1, 9);
  std::vector<float> o(40 * in.s.o_stride);
  const std::vector<int32_t> ids = make_routing(40, 1, 5, 3);
  focus::FocusLayerCache fc;
  fc.reset(5, 1);
  fc.append(ids.data(), nullptr, 30);  // hard routing of 30 positions, no soft assignments
  auto call = [&](focus::FocusMode mode, int64_t pos0) {
    focus::cpu::focus_cached_attention(in.q.data(), in.k.data(), in.v.data(), o.data(), in.s, pos0, 1, mode, fc);
  };
  EXPECT_NO_THROW(call(focus::FocusMode::Hard, 29));
  EXPECT_THROW(call(focus::FocusMode::Hard, 30), focus::Error);  // position 30 was never routed
  EXPECT_THROW(call(focus::FocusMode::Soft, 10), focus::Error);  // filled in hard mode
  EXPECT_THROW(fc.truncate(31), focus::Error);
}

TEST(FocusAttentionBench, JsonKeysErrorsAndSkippedRuns) {
  focus::AttnBenchOptions o;
  o.n = 700;
  o.heads = 4;
  o.kv_heads = 2;
  o.dim = 16;
  o.local_window = 32;
  o.groups = 5;
  o.topk = 2;
  o.reps = 1;
  o.dense_reps = 1;
  o.dense_tiles = false;
  nlohmann::json j;
  ASSERT_EQ(focus::run_attention_bench(o, &j), 0);
  for (const char* key : {"dense_ms", "fused_ms", "twocall_ms", "density", "speedup_fused", "speedup_twocall",
                          "gflops_dense", "gflops_fused", "max_err_fused", "max_err_twocall"})
    ASSERT_TRUE(j.contains(key)) << key;
  EXPECT_GT(j["density"].get<double>(), 0.0);
  EXPECT_LT(j["density"].get<double>(), 1.0);
  EXPECT_LT(j["max_err_fused"].get<double>(), 1e-5);
  EXPECT_LT(j["max_err_twocall"].get<double>(), 1e-5);
  // Derived numbers agree with the timings they come from.
  auto ratio = [&](const char* a, const char* b) { return j[a].get<double>() / j[b].get<double>(); };
  EXPECT_DOUBLE_EQ(j["speedup_fused"].get<double>(), ratio("dense_ms", "fused_ms"));
  EXPECT_DOUBLE_EQ(j["speedup_twocall"].get<double>(), ratio("dense_ms", "twocall_ms"));
  const double causal_pairs = 700.0 * 701 / 2, flop_per_pair = 4.0 * o.dim * o.heads;
  EXPECT_NEAR(j["gflops_dense"].get<double>() * j["dense_ms"].get<double>() * 1e6 / flop_per_pair, causal_pairs,
              1e-6 * causal_pairs);
  EXPECT_NEAR(j["gflops_fused"].get<double>() * j["fused_ms"].get<double>() * 1e6 / flop_per_pair,
              j["density"].get<double>() * causal_pairs, 1e-6 * causal_pairs);
  EXPECT_TRUE(j["dense_tiles_ms"].is_null());
  // Decoding: the last row from the cache against the reference; fewer keys read than cached.
  EXPECT_EQ(j["decode_tokens"].get<int64_t>(), 32);
  EXPECT_LT(j["max_err_decode"].get<double>(), 1e-5);
  EXPECT_GT(j["decode_keys_per_token"].get<double>(), (double)o.local_window);
  EXPECT_LT(j["decode_keys_per_token"].get<double>(), (double)o.n);
  EXPECT_DOUBLE_EQ(j["speedup_decode"].get<double>(), ratio("decode_dense_us", "decode_focus_us"));
  // Dense through the Focus decode kernel (every key) gives what the dense flash kernel gives.
  EXPECT_LT(j["max_err_decode_dense_split"].get<double>(), 1e-5);
  EXPECT_DOUBLE_EQ(j["speedup_decode_same_kernel"].get<double>(), ratio("decode_dense_split_us", "decode_focus_us"));
  o.dense_tiles = true;
  o.decode = 0;
  ASSERT_EQ(focus::run_attention_bench(o, &j), 0);
  EXPECT_GT(j["dense_tiles_ms"].get<double>(), 0.0);
  EXPECT_TRUE(j["speedup_decode"].is_null());
  EXPECT_TRUE(j["decode_dense_split_us"].is_null());
  o.dense_reps = 0;
  ASSERT_EQ(focus::run_attention_bench(o, &j), 0);
  EXPECT_TRUE(j["dense_ms"].is_null());
  EXPECT_TRUE(j["speedup_fused"].is_null());
  EXPECT_TRUE(j["dense_tiles_ms"].is_null());
}

TEST(FocusAttentionBench, DensityIsTheExactPairCount) {
  // Window 1, no sinks, top-1: a token sees exactly the earlier members of its own group (and
  // itself). The benchmark's router is exactly balanced (5 groups of 140 of 700 tokens), so
  // whatever the permutation there are 5 * 140 * 141 / 2 visible pairs of 700 * 701 / 2.
  focus::AttnBenchOptions o;
  o.n = 700;
  o.heads = 2;
  o.kv_heads = 1;
  o.dim = 8;
  o.local_window = 1;
  o.groups = 5;
  o.topk = 1;
  o.reps = 1;
  o.dense_reps = 0;
  o.dense_tiles = false;
  o.decode = 0;
  for (const uint64_t seed : {1, 2}) {
    o.seed = seed;
    nlohmann::json j;
    ASSERT_EQ(focus::run_attention_bench(o, &j), 0);
    EXPECT_DOUBLE_EQ(j["density"].get<double>(), (5.0 * 140 * 141 / 2) / (700.0 * 701 / 2));
    EXPECT_DOUBLE_EQ(j["load_max_over_mean"].get<double>(), 1.0);
    EXPECT_LT(j["max_err_fused"].get<double>(), 1e-5);
  }
}
