// Router, Sinkhorn balancing, SwAV loss, bias balancing, group load statistics.
// Gradients: a float64 reference (forward + analytic backward) is checked against central
// differences to 1e-6 relative; the fp32 code is checked against the float64 reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "focus/balancing.h"
#include "focus/router.h"
#include "test_util.h"

using focus::RouterConfig;
using focus::RouterParams;
using focus::RouterSide;

namespace {

using VD = std::vector<double>;
using VF = std::vector<float>;

using focus::test::rel_err;
using focus::test::to_d;

// ---- float64 reference router: params in RouterParams layout ---------------------------------
struct RefRouter {
  RouterConfig c;
  double tau(const VD& prm) const {
    return c.learn_tau ? std::exp(prm[c.d_g * c.dim + c.groups * c.d_g]) : (double)c.tau;
  }
  // s [N, G], p [N, G]
  void forward(const VD& prm, const VD& b, const VD& x, int64_t n, VD& s, VD& p) const {
    const int64_t D = c.dim, dg = c.d_g, G = c.groups;
    const double* W = prm.data();
    const double* C = prm.data() + dg * D;
    const double t = tau(prm);
    s.assign(n * G, 0);
    p.assign(n * G, 0);
    for (int64_t i = 0; i < n; ++i) {
      VD r(dg, 0.0);
      double rn = 0;
      for (int64_t a = 0; a < dg; ++a) {
        for (int64_t d = 0; d < D; ++d) r[a] += W[a * D + d] * x[i * D + d];
        rn += r[a] * r[a];
      }
      rn = std::sqrt(rn);
      double mx = -INFINITY, sum = 0;
      for (int64_t g = 0; g < G; ++g) {
        double cn = 0, dot = 0;
        for (int64_t a = 0; a < dg; ++a) cn += C[g * dg + a] * C[g * dg + a], dot += r[a] * C[g * dg + a];
        s[i * G + g] = dot / (rn * std::sqrt(cn)) / t;
        mx = std::max(mx, s[i * G + g] + b[g]);
      }
      for (int64_t g = 0; g < G; ++g) sum += p[i * G + g] = std::exp(s[i * G + g] + b[g] - mx);
      for (int64_t g = 0; g < G; ++g) p[i * G + g] /= sum;
    }
  }
  // Analytic backward of L with dL/dp = dp, dL/ds (direct) = ds.
  void backward(const VD& prm, const VD& b, const VD& x, int64_t n, const VD& dp, const VD& ds, VD& dprm,
                VD& dx) const {
    const int64_t D = c.dim, dg = c.d_g, G = c.groups;
    const double* W = prm.data();
    const double* C = prm.data() + dg * D;
    const double t = tau(prm);
    VD s, p;
    forward(prm, b, x, n, s, p);
    dprm.assign(prm.size(), 0);
    dx.assign(n * D, 0);
    for (int64_t i = 0; i < n; ++i) {
      VD r(dg, 0.0), du(dg, 0.0);
      double rn = 0, pdp = 0;
      for (int64_t a = 0; a < dg; ++a) {
        for (int64_t d = 0; d < D; ++d) r[a] += W[a * D + d] * x[i * D + d];
        rn += r[a] * r[a];
      }
      rn = std::sqrt(rn);
      for (int64_t g = 0; g < G; ++g) pdp += p[i * G + g] * dp[i * G + g];
      for (int64_t g = 0; g < G; ++g) {
        const double dsg = p[i * G + g] * (dp[i * G + g] - pdp) + ds[i * G + g];
        if (c.learn_tau) dprm.back() -= dsg * s[i * G + g];
        const double dcos = dsg / t;
        double cn = 0, ucs = 0;
        for (int64_t a = 0; a < dg; ++a) cn += C[g * dg + a] * C[g * dg + a];
        cn = std::sqrt(cn);
        for (int64_t a = 0; a < dg; ++a) ucs += r[a] / rn * C[g * dg + a] / cn;
        for (int64_t a = 0; a < dg; ++a) {
          du[a] += dcos * C[g * dg + a] / cn;
          // d cos / d c = (u - c_hat cos) / |c|
          dprm[dg * D + g * dg + a] += dcos * (r[a] / rn - C[g * dg + a] / cn * ucs) / cn;
        }
      }
      double udu = 0;
      for (int64_t a = 0; a < dg; ++a) udu += r[a] / rn * du[a];
      for (int64_t a = 0; a < dg; ++a) {
        const double dr = (du[a] - r[a] / rn * udu) / rn;
        for (int64_t d = 0; d < D; ++d) {
          dprm[a * D + d] += dr * x[i * D + d];
          dx[i * D + d] += dr * W[a * D + d];
        }
      }
    }
  }
};

struct RouterCase {
  int64_t D, dg, G, n;
  bool learn_tau;
};

RouterParams make_router(const RouterCase& rc, uint64_t seed) {
  RouterConfig cfg;
  cfg.dim = rc.D;
  cfg.d_g = rc.dg;
  cfg.groups = rc.G;
  cfg.tau = 0.3f;
  cfg.learn_tau = rc.learn_tau;
  RouterParams rp = focus::router_init(cfg, seed);
  std::mt19937 rng((uint32_t)seed);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (auto& b : rp.bias) b = nd(rng);
  return rp;
}

VF randn(size_t n, uint32_t seed, float sd = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  VF x(n);
  for (auto& e : x) e = nd(rng);
  return x;
}

}  // namespace

// ---- router ----------------------------------------------------------------------------------

TEST(Router, InitIsSeededAndScaled) {
  RouterConfig cfg;
  cfg.dim = 256;
  cfg.d_g = 16;
  cfg.groups = 8;
  const RouterParams a = focus::router_init(cfg, 7), b = focus::router_init(cfg, 7), c = focus::router_init(cfg, 8);
  EXPECT_EQ(a.params, b.params);
  EXPECT_NE(a.params, c.params);
  EXPECT_EQ((int64_t)a.params.size(), 16 * 256 + 8 * 16);
  double var = 0;
  for (int64_t i = 0; i < 16 * 256; ++i) var += a.params[i] * a.params[i];
  EXPECT_NEAR(var / (16 * 256), 1.0 / 256, 0.2 / 256);
  for (int64_t g = 0; g < 8; ++g) {
    double n2 = 0;
    for (int64_t d = 0; d < 16; ++d) n2 += a.centroids()[g * 16 + d] * a.centroids()[g * 16 + d];
    EXPECT_NEAR(n2, 1.0, 1e-5);
  }
  cfg.learn_tau = true;
  const RouterParams t = focus::router_init(cfg, 7);
  EXPECT_EQ(t.size(), a.size() + 1);
  EXPECT_NEAR(t.tau(), cfg.tau, 1e-6);
  cfg.d_g = 300;
  EXPECT_THROW(focus::router_init(cfg, 1), focus::Error);
}

TEST(Router, ReferenceBackwardMatchesFiniteDifferences) {
  for (const RouterCase rc : {RouterCase{8, 3, 4, 5, true}, RouterCase{37, 16, 4, 6, true},
                              RouterCase{12, 4, 1, 4, false}, RouterCase{16, 16, 8, 3, true}}) {
    SCOPED_TRACE(::testing::Message() << "D " << rc.D << " d_g " << rc.dg << " G " << rc.G);
    const RouterParams rp = make_router(rc, 11);
    const RefRouter ref{rp.cfg};
    VD prm = to_d(rp.params), b = to_d(rp.bias), x = to_d(randn(rc.n * rc.D, 12));
    const VD wp = to_d(randn(rc.n * rc.G, 13)), ws = to_d(randn(rc.n * rc.G, 14));
    VD dprm, dx;
    ref.backward(prm, b, x, rc.n, wp, ws, dprm, dx);
    auto loss = [&] {  // L = sum(wp * p) + sum(ws * s)
      VD s, p;
      ref.forward(prm, b, x, rc.n, s, p);
      double L = 0;
      for (size_t i = 0; i < p.size(); ++i) L += wp[i] * p[i] + ws[i] * s[i];
      return L;
    };
    auto numeric = [&](VD& v) {
      VD g(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        const double v0 = v[i], h = 1e-5;
        v[i] = v0 + h;
        const double lp = loss();
        v[i] = v0 - h;
        const double lm = loss();
        v[i] = v0;
        g[i] = (lp - lm) / (2 * h);
      }
      return g;
    };
    EXPECT_LT(rel_err(dprm, numeric(prm)), 1e-6) << "params";
    EXPECT_LT(rel_err(dx, numeric(x)), 1e-6) << "x";
  }
}

TEST(Router, KernelMatchesReference) {
  for (const RouterCase rc : {RouterCase{8, 3, 4, 5, true}, RouterCase{37, 16, 4, 70, true},
                              RouterCase{576, 16, 16, 130, false}, RouterCase{64, 64, 1, 9, true}}) {
    SCOPED_TRACE(::testing::Message() << "D " << rc.D << " d_g " << rc.dg << " G " << rc.G);
    const RouterParams rp = make_router(rc, 21);
    const VF x = randn(rc.n * rc.D, 22), dp = randn(rc.n * rc.G, 23), ds = randn(rc.n * rc.G, 24);
    focus::RouterCache cache;
    focus::router_forward(rp, x.data(), rc.n, cache);
    VF dprm(rp.size(), 0.f), dx(rc.n * rc.D, 0.f);
    focus::router_backward(rp, x.data(), cache, dp.data(), ds.data(), dprm.data(), dx.data());

    const RefRouter ref{rp.cfg};
    VD s, p, rdprm, rdx;
    ref.forward(to_d(rp.params), to_d(rp.bias), to_d(x), rc.n, s, p);
    ref.backward(to_d(rp.params), to_d(rp.bias), to_d(x), rc.n, to_d(dp), to_d(ds), rdprm, rdx);
    EXPECT_LT(rel_err(cache.s, s), 1e-5) << "s";
    EXPECT_LT(rel_err(cache.p, p), 1e-5) << "p";
    EXPECT_LT(rel_err(dprm, rdprm), 1e-4) << "dparams";
    EXPECT_LT(rel_err(dx, rdx), 1e-4) << "dx";
    if (rp.cfg.learn_tau) {
      EXPECT_NEAR(dprm.back(), rdprm.back(), 1e-4 * (1 + std::fabs(rdprm.back()))) << "dlog_tau";
    }

    // dp only / ds only (null pointers) and accumulation.
    VF g1(rp.size(), 0.f), g2(rp.size(), 0.f), g12(rp.size(), 1.f);
    focus::router_backward(rp, x.data(), cache, dp.data(), nullptr, g1.data(), nullptr);
    focus::router_backward(rp, x.data(), cache, nullptr, ds.data(), g2.data(), nullptr);
    focus::router_backward(rp, x.data(), cache, dp.data(), ds.data(), g12.data(), nullptr);
    for (int64_t i = 0; i < rp.size(); ++i) ASSERT_NEAR(g12[i], 1.f + g1[i] + g2[i], 1e-4 * (1 + std::fabs(g12[i])));
  }
}

// A token's routing may not depend on the rows routed with it: prefill routes thousands of rows
// at once, decoding one, a chunk a few. Scores are bitwise those of the token routed alone.
TEST(Router, ScoresDoNotDependOnTheRowsRoutedTogether) {
  for (const RouterCase rc : {RouterCase{576, 16, 16, 41, false}, RouterCase{37, 20, 4, 23, true},
                              RouterCase{64, 5, 3, 18, false}}) {
    SCOPED_TRACE(::testing::Message() << "D " << rc.D << " d_g " << rc.dg);
    const RouterParams rp = make_router(rc, 31);
    const VF x = randn(rc.n * rc.D, 32);
    focus::RouterCache all;
    focus::router_forward(rp, x.data(), rc.n, all);
    for (int64_t i = 0; i < rc.n; ++i) {
      focus::RouterCache one;
      focus::router_forward(rp, x.data() + i * rc.D, 1, one);
      for (int64_t g = 0; g < rc.G; ++g) ASSERT_EQ(one.s[g], all.s[i * rc.G + g]) << "row " << i << " group " << g;
    }
    for (int64_t i0 = 0; i0 + 5 <= rc.n; i0 += 5) {  // chunks of 5 rows
      focus::RouterCache five;
      focus::router_forward(rp, x.data() + i0 * rc.D, 5, five);
      for (int64_t k = 0; k < 5 * rc.G; ++k) ASSERT_EQ(five.s[k], all.s[i0 * rc.G + k]) << "chunk at " << i0;
    }
    // The same from projections kept side by side (inference policies keep every router's key and
    // query projections so): this router's query and key sides among another router's.
    RouterConfig kc = rp.cfg;
    kc.key_proj = true;  // a key projection of its own
    const RouterParams asym = focus::router_init(kc, 41), other = make_router(rc, 77);
    // Five projections: a decoding row's columns are split over the threads when they are many.
    const focus::RouterProjections kept = focus::router_projections(
        {{&other, focus::RouterSide::Query}, {&asym, focus::RouterSide::Query}, {&asym, focus::RouterSide::Key},
         {&other, focus::RouterSide::Key}, {&other, focus::RouterSide::Query}});
    focus::RouterCache all_queries, all_keys;
    focus::router_forward(asym, x.data(), rc.n, all_queries, focus::RouterSide::Query);
    focus::router_forward(asym, x.data(), rc.n, all_keys, focus::RouterSide::Key);
    const int saved = focus::num_threads();
    const std::pair<int64_t, int> runs[] = {{1, 1}, {1, 2}, {1, 3}, {5, 2}, {rc.n, 2}};  // rows, threads
    for (const auto& [rows, threads] : runs) {
      focus::set_threads(threads);
      std::vector<float> pr(rows * kept.stride);
      for (int64_t i0 = 0; i0 + rows <= rc.n; i0 += rows) {
        kept.project(x.data() + i0 * rc.D, rows, pr.data());
        focus::RouterCache q, k;
        focus::router_forward(asym, nullptr, rows, q, focus::RouterSide::Query, true, pr.data() + kept.offset[1],
                              kept.stride);
        focus::router_forward(asym, nullptr, rows, k, focus::RouterSide::Key, true, pr.data() + kept.offset[2],
                              kept.stride);
        for (int64_t g = 0; g < rows * rc.G; ++g) {
          ASSERT_EQ(q.s[g], all_queries.s[i0 * rc.G + g]) << "kept projections, " << rows << " rows at " << i0;
          ASSERT_EQ(k.s[g], all_keys.s[i0 * rc.G + g]) << "kept projections (keys), " << rows << " rows at " << i0;
        }
      }
    }
    focus::set_threads(saved);
  }
}

// The far-pair terms come out of a kept projection (their vectors as columns beside the routers'
// projections) bitwise as router_far_bias computes them from x, for any number of rows and threads;
// and they are the formula's, against a float64 dot product.
TEST(Router, FarTermsFromKeptProjectionsAreRouterFarBias) {
  for (const RouterCase rc : {RouterCase{576, 16, 16, 41, false}, RouterCase{37, 5, 4, 23, false}}) {
    SCOPED_TRACE(::testing::Message() << "D " << rc.D);
    RouterConfig cfg;
    cfg.dim = rc.D;
    cfg.d_g = rc.dg;
    cfg.groups = rc.G;
    cfg.key_proj = true;
    cfg.far_bias = true;
    std::vector<RouterParams> rps;
    for (uint64_t seed : {51, 52}) {
      RouterParams rp = focus::router_init(cfg, seed);
      const VF f = randn(2 * (rc.D + 1), seed + 100);  // the terms start at zero: give them weights
      for (RouterSide side : {RouterSide::Query, RouterSide::Key})
        for (int64_t d = 0; d <= rc.D; ++d)
          rp.params[rp.far_offset(side) + d] = 0.1f * f[(side == RouterSide::Key ? rc.D + 1 : 0) + d];
      rps.push_back(rp);
    }
    std::vector<std::pair<const RouterParams*, RouterSide>> list;
    for (const RouterParams& rp : rps) list.push_back({&rp, RouterSide::Key}), list.push_back({&rp, RouterSide::Query});
    const focus::RouterProjections kept = focus::router_projections(list, list);
    ASSERT_EQ(kept.far.size(), 4u);
    const VF x = randn(rc.n * rc.D, 53);
    const int saved = focus::num_threads();
    const std::pair<int64_t, int> runs[] = {{1, 1}, {1, 2}, {5, 2}, {rc.n, 1}, {rc.n, 2}};  // rows, threads
    for (const auto& [rows, threads] : runs) {
      focus::set_threads(threads);
      std::vector<float> pr(rows * kept.stride), want(rows), got(rows);
      kept.project(x.data(), rows, pr.data());
      for (size_t p = 0; p < list.size(); ++p) {
        const auto& [rp, side] = list[p];
        focus::router_far_bias(*rp, x.data(), rows, side, want.data());
        focus::router_far_bias_projected(*rp, side, pr.data() + kept.far[p], kept.stride, rows, got.data());
        ASSERT_EQ(got, want) << rows << " rows, " << threads << " threads, term " << p;
        const float* fv = rp->params.data() + rp->far_offset(side);
        for (int64_t i = 0; i < rows; ++i) {
          double dot = 0;
          for (int64_t d = 0; d < rc.D; ++d) dot += (double)fv[d] * x[i * rc.D + d];
          const double e = std::clamp(focus::kFarBiasGain * (dot / std::sqrt((double)rc.D) + fv[rc.D]),
                                      -(double)focus::kFarBiasLimit, (double)focus::kFarBiasLimit);
          ASSERT_NEAR(want[i], e, 1e-4 * std::max(1.0, std::fabs(e))) << "row " << i << ", term " << p;
        }
      }
    }
    focus::set_threads(saved);
  }
}

TEST(Router, TopKIsSortedAndMatchesBruteForce) {
  const int64_t n = 200, G = 8;
  const VF s = randn(n * G, 31), b = randn(G, 32);
  for (int k : {1, 2}) {
    std::vector<int32_t> out(n * k);
    focus::router_topk(s.data(), b.data(), n, G, k, out.data());
    for (int64_t i = 0; i < n; ++i) {
      std::vector<std::pair<float, int>> v;
      for (int g = 0; g < G; ++g) v.push_back({-(s[i * G + g] + b[g]), g});
      std::sort(v.begin(), v.end());
      std::vector<int32_t> want;
      for (int t = 0; t < k; ++t) want.push_back(v[t].second);
      std::sort(want.begin(), want.end());
      for (int t = 0; t < k; ++t) ASSERT_EQ(out[i * k + t], want[t]) << "token " << i << " k " << k;
    }
  }
  const float tie[4] = {1.f, 3.f, 3.f, 3.f};
  int32_t o2[2];
  focus::router_topk(tie, nullptr, 1, 4, 2, o2);
  EXPECT_EQ(o2[0], 1);
  EXPECT_EQ(o2[1], 2);
  EXPECT_THROW(focus::router_topk(tie, nullptr, 1, 4, 5, o2), focus::Error);
}

TEST(Router, TopPTakesTheFewestGroupsReachingTheMass) {
  // Brute force: sort by probability (ties to the lower index), take groups until their summed
  // softmax reaches p or kmax are taken; unused slots -1, used ones ascending.
  const int64_t n = 300, G = 8;
  const VF s = randn(n * G, 41), b = randn(G, 42);
  for (float p : {0.3f, 0.6f, 0.9f, 1.0f})
    for (int kmax : {1, 3, 8}) {
      std::vector<int32_t> out(n * kmax);
      focus::router_topp(s.data(), b.data(), n, G, p, kmax, out.data());
      int64_t used_total = 0;
      for (int64_t i = 0; i < n; ++i) {
        std::vector<double> pr(G);
        double z = 0;
        for (int g = 0; g < G; ++g) z += pr[g] = std::exp((double)s[i * G + g] + b[g]);
        std::vector<int> order(G);
        for (int g = 0; g < G; ++g) order[g] = g, pr[g] /= z;
        std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return pr[a] > pr[c]; });
        std::vector<int32_t> want;
        double acc = 0;
        for (int t = 0; t < kmax && acc < p - 1e-6; ++t) want.push_back(order[t]), acc += pr[order[t]];
        std::sort(want.begin(), want.end());
        used_total += (int64_t)want.size();
        for (int t = 0; t < kmax; ++t)
          ASSERT_EQ(out[i * kmax + t], t < (int)want.size() ? want[t] : -1) << "token " << i << " p " << p << " kmax " << kmax;
      }
      if (kmax == 8 && p < 0.5f) {
        EXPECT_LT(used_total, n * 4) << "top-p should read few groups for small p";
      }
    }
  int32_t o[2];
  const float one[4] = {0.f, 0.f, 0.f, 0.f};
  EXPECT_THROW(focus::router_topp(one, nullptr, 1, 4, 0.f, 2, o), focus::Error);
  EXPECT_THROW(focus::router_topp(one, nullptr, 1, 4, 0.5f, 5, o), focus::Error);
}

// ---- Sinkhorn and the SwAV loss ----------------------------------------------------------------

TEST(Sinkhorn, MarginalsAreMet) {
  for (auto [n, G] : {std::pair<int64_t, int64_t>{200, 8}, {1000, 16}, {37, 4}}) {
    const VF logits = randn(n * G, 41 + n);
    VF q(n * G);
    focus::sinkhorn_forward(logits.data(), n, G, 1.f, 100, q.data());
    double worst_row = 0, worst_col = 0;
    for (int64_t i = 0; i < n; ++i) {
      double r = 0;
      for (int64_t g = 0; g < G; ++g) r += q[i * G + g];
      worst_row = std::max(worst_row, std::fabs(r - 1));
    }
    for (int64_t g = 0; g < G; ++g) {
      double c = 0;
      for (int64_t i = 0; i < n; ++i) c += q[i * G + g];
      worst_col = std::max(worst_col, std::fabs(c / ((double)n / G) - 1));
    }
    EXPECT_LT(worst_row, 1e-5) << n;
    EXPECT_LT(worst_col, 1e-4) << n;
  }
}

TEST(Sinkhorn, MatchesPlainDoubleSinkhornAndZeroItersIsSoftmax) {
  const int64_t n = 50, G = 5;
  const VF logits = randn(n * G, 51);
  for (int iters : {0, 1, 3}) {
    VF q(n * G);
    focus::sinkhorn_forward(logits.data(), n, G, 2.f, iters, q.data());
    // Plain (not log-domain) Sinkhorn in double, same order: rows, then (columns, rows) x iters.
    VD K(n * G);
    for (int64_t i = 0; i < n * G; ++i) K[i] = std::exp(2.0 * logits[i]);
    auto rows = [&] {
      for (int64_t i = 0; i < n; ++i) {
        double r = 0;
        for (int64_t g = 0; g < G; ++g) r += K[i * G + g];
        for (int64_t g = 0; g < G; ++g) K[i * G + g] /= r;
      }
    };
    rows();
    for (int it = 0; it < iters; ++it) {
      for (int64_t g = 0; g < G; ++g) {
        double c = 0;
        for (int64_t i = 0; i < n; ++i) c += K[i * G + g];
        for (int64_t i = 0; i < n; ++i) K[i * G + g] *= ((double)n / G) / c;
      }
      rows();
    }
    EXPECT_LT(rel_err(q, K), 1e-5) << "iters " << iters;
  }
}

TEST(Sinkhorn, StableWithLargeScores) {
  // Scores of order 1e3: exp() overflows fp32 outside the log domain.
  const int64_t G = 8;
  {
    // Every token prefers group 0 by 3e3: the balanced answer is uniform (to fp32 resolution of
    // log-space values near 3e3, about 2.4e-4 relative).
    const int64_t n = 64;
    VF logits(n * G, 0.f), q(n * G);
    for (int64_t i = 0; i < n; ++i) logits[i * G] = 3e3f;
    focus::sinkhorn_forward(logits.data(), n, G, 1.f, 3, q.data());
    for (float x : q) ASSERT_NEAR(x, 1.0 / G, 1e-3 / G);
  }
  // Random scores of scale 1e3: finite, rows exact, and equal to a float64 log-domain Sinkhorn
  // (the transport is nearly a hard assignment here, so the columns converge slowly in any precision).
  const int64_t n = 256;
  VF logits = randn(n * G, 61, 1e3f);
  for (int64_t i = 0; i < n; ++i) logits[i * G + 0] += 3e3f;
  const int iters = 50;
  VF q(n * G);
  focus::sinkhorn_forward(logits.data(), n, G, 1.f, iters, q.data());
  VD u(n, 0), v(G, 0);
  auto lse_rows = [&] {
    for (int64_t i = 0; i < n; ++i) {
      double mx = -INFINITY, sum = 0;
      for (int64_t g = 0; g < G; ++g) mx = std::max(mx, logits[i * G + g] + v[g]);
      for (int64_t g = 0; g < G; ++g) sum += std::exp(logits[i * G + g] + v[g] - mx);
      u[i] = -(mx + std::log(sum));
    }
  };
  lse_rows();
  for (int it = 0; it < iters; ++it) {
    for (int64_t g = 0; g < G; ++g) {
      double mx = -INFINITY, sum = 0;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, logits[i * G + g] + u[i]);
      for (int64_t i = 0; i < n; ++i) sum += std::exp(logits[i * G + g] + u[i] - mx);
      v[g] = std::log((double)n / G) - (mx + std::log(sum));
    }
    lse_rows();
  }
  double max_diff = 0;
  for (int64_t i = 0; i < n; ++i) {
    double r = 0;
    for (int64_t g = 0; g < G; ++g) {
      ASSERT_TRUE(std::isfinite(q[i * G + g]));
      r += q[i * G + g];
      max_diff = std::max(max_diff, std::fabs(q[i * G + g] - std::exp(logits[i * G + g] + u[i] + v[g])));
    }
    ASSERT_NEAR(r, 1.0, 1e-5);
  }
  EXPECT_LT(max_diff, 1e-3);
}

TEST(SwavLoss, ReferenceAndKernelGradients) {
  const int64_t n = 40, G = 6;
  const VF s = randn(n * G, 71, 2.f), b = randn(G, 72);
  VF q(n * G);
  focus::sinkhorn_forward(s.data(), n, G, 1.f, 3, q.data());
  // float64 reference: L = -(1/N) sum q log softmax(s + b); dL/ds = (p sum(q) - q) / N.
  auto ref_loss = [&](const VD& sd) {
    double L = 0;
    for (int64_t i = 0; i < n; ++i) {
      double mx = -INFINITY, sum = 0;
      for (int64_t g = 0; g < G; ++g) mx = std::max(mx, sd[i * G + g] + b[g]);
      for (int64_t g = 0; g < G; ++g) sum += std::exp(sd[i * G + g] + b[g] - mx);
      for (int64_t g = 0; g < G; ++g) L -= q[i * G + g] * (sd[i * G + g] + b[g] - mx - std::log(sum));
    }
    return L / n;
  };
  VD sd = to_d(s), ref_grad(n * G), num(n * G);
  for (int64_t i = 0; i < n; ++i) {
    double mx = -INFINITY, sum = 0, qs = 0;
    for (int64_t g = 0; g < G; ++g) mx = std::max(mx, sd[i * G + g] + b[g]), qs += q[i * G + g];
    for (int64_t g = 0; g < G; ++g) sum += std::exp(sd[i * G + g] + b[g] - mx);
    for (int64_t g = 0; g < G; ++g)
      ref_grad[i * G + g] = (std::exp(sd[i * G + g] + b[g] - mx) / sum * qs - q[i * G + g]) / n;
  }
  for (int64_t i = 0; i < n * G; ++i) {
    const double s0 = sd[i], h = 1e-5;
    sd[i] = s0 + h;
    const double lp = ref_loss(sd);
    sd[i] = s0 - h;
    const double lm = ref_loss(sd);
    sd[i] = s0;
    num[i] = (lp - lm) / (2 * h);
  }
  EXPECT_LT(rel_err(ref_grad, num), 1e-6);
  EXPECT_NEAR(focus::swav_loss_forward(s.data(), b.data(), q.data(), n, G), ref_loss(sd), 1e-5);
  VF ds(n * G, 0.f);
  focus::swav_loss_backward(s.data(), b.data(), q.data(), n, G, 1.f, ds.data());
  EXPECT_LT(rel_err(ds, ref_grad), 1e-4);
}

TEST(SwavLoss, FlowsIntoTheRouter) {
  // The SwAV gradient enters router_backward as ds; check the chain against float64.
  const RouterCase rc{24, 8, 4, 30, true};
  const RouterParams rp = make_router(rc, 81);
  const VF x = randn(rc.n * rc.D, 82);
  focus::RouterCache cache;
  focus::router_forward(rp, x.data(), rc.n, cache);
  VF q(rc.n * rc.G), ds(rc.n * rc.G, 0.f), dprm(rp.size(), 0.f);
  focus::sinkhorn_forward(cache.s.data(), rc.n, rc.G, 1.f, 3, q.data());
  focus::swav_loss_backward(cache.s.data(), rp.bias.data(), q.data(), rc.n, rc.G, 1.f, ds.data());
  focus::router_backward(rp, x.data(), cache, nullptr, ds.data(), dprm.data(), nullptr);
  // float64: L(params) = swav(s(params)) with q held fixed, by central differences.
  const RefRouter ref{rp.cfg};
  VD prm = to_d(rp.params), num(prm.size());
  auto loss = [&] {
    VD s, p;
    ref.forward(prm, to_d(rp.bias), to_d(x), rc.n, s, p);
    double L = 0;
    for (int64_t i = 0; i < rc.n * rc.G; ++i) L -= q[i] * std::log(p[i]);
    return L / rc.n;
  };
  for (size_t i = 0; i < prm.size(); ++i) {
    const double v0 = prm[i], h = 1e-5;
    prm[i] = v0 + h;
    const double lp = loss();
    prm[i] = v0 - h;
    const double lm = loss();
    prm[i] = v0;
    num[i] = (lp - lm) / (2 * h);
  }
  EXPECT_LT(rel_err(dprm, num), 1e-4);
}

// ---- bias balancing --------------------------------------------------------------------------

TEST(BiasBalancer, MovesAgainstTheLoadAndBalances) {
  const int64_t G = 4;
  focus::BiasBalancer bb(G, 0.1f);
  const int32_t groups[8] = {0, 0, 0, 0, 0, 1, 2, 2};  // group 0 overloaded, group 3 empty
  bb.observe(groups, 8, 1);
  VF bias(G, 0.f);
  bb.update(bias.data());
  EXPECT_LT(bias[0], 0.f);
  EXPECT_GT(bias[3], 0.f);
  EXPECT_LT(bias[0], bias[1]);
  EXPECT_NEAR(bias[0] + bias[1] + bias[2] + bias[3], 0.f, 1e-6);

  // Closed loop: scores that all favour group 0; hard top-1 with the bias gets balanced.
  const int64_t n = 512, Gb = 8;
  VF s = randn(n * Gb, 91);
  for (int64_t i = 0; i < n; ++i) s[i * Gb] += 2.f;
  {
    focus::BiasBalancer loop(Gb, 0.05f, 0.5f);
    VF b(Gb, 0.f);
    std::vector<int32_t> top(n);
    focus::router_topk(s.data(), b.data(), n, Gb, 1, top.data());
    const double before = focus::group_load_stats(top.data(), n, 1, Gb).max_over_mean;
    for (int step = 0; step < 300; ++step) {
      focus::router_topk(s.data(), b.data(), n, Gb, 1, top.data());
      loop.observe(top.data(), n, 1);
      loop.update(b.data());
    }
    focus::router_topk(s.data(), b.data(), n, Gb, 1, top.data());
    const double after = focus::group_load_stats(top.data(), n, 1, Gb).max_over_mean;
    EXPECT_GT(before, 3.0);
    EXPECT_LT(after, 1.5);
  }
  // Soft loads.
  focus::BiasBalancer soft(2, 0.1f);
  const float p[4] = {0.9f, 0.1f, 0.8f, 0.2f};
  soft.observe_soft(p, 2);
  VF b2(2, 0.f);
  soft.update(b2.data());
  EXPECT_LT(b2[0], b2[1]);
}

TEST(GroupLoadStats, CountsAndRejectsBadIds) {
  const int32_t g[6] = {0, 1, 1, 3, 1, 3};  // [3 tokens, k = 2]
  const auto st = focus::group_load_stats(g, 3, 2, 4);
  EXPECT_EQ(st.histogram, (std::vector<int64_t>{1, 3, 0, 2}));
  EXPECT_EQ(st.max, 3);
  EXPECT_EQ(st.min, 0);
  EXPECT_DOUBLE_EQ(st.mean, 1.5);
  EXPECT_DOUBLE_EQ(st.max_over_mean, 2.0);
  const int32_t bad[2] = {0, 4};
  EXPECT_THROW(focus::group_load_stats(bad, 2, 1, 4), focus::Error);
  // Empty groups still count in the mean: top-1 of 6 tokens over 4 groups, sizes 3, 1, 2, 0.
  const int32_t g1[6] = {2, 0, 2, 1, 0, 2};
  EXPECT_DOUBLE_EQ(focus::group_load_stats(g1, 6, 1, 4).max_over_mean, 3.0 * 4 / 6);
}
