// Soft-mode Focus attention: forward and hand-written backward.
//  - a float64 reference (forward + analytic backward) is checked against central differences to
//    1e-6 relative: that proves the formulas;
//  - the fp32 tiled kernel is checked against the float64 reference (1e-4 relative to the largest
//    gradient entry): that proves the kernel implements the formulas;
//  - p == nullptr equals the dense flash kernel; causality and determinism are exact.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/soft_attention.h"
#include "kernels/cpu/attention.h"
#include "test_util.h"

using focus::cpu::AttnShape;

namespace {

using VD = std::vector<double>;
using VF = std::vector<float>;

// ---- float64 reference ---------------------------------------------------------------------
// Same layouts as the kernel: q [N,H,Dh], k/v [N,HKV,Dh], p [N,G] (empty: no bias).
struct Ref {
  AttnShape s;
  bool visible(int64_t i, int64_t j) const {
    return j <= i && (s.sliding_window <= 0 || i - j < s.sliding_window);
  }
  bool biased(int64_t i, int64_t j) const { return i - j >= s.local_window && j >= s.sinks; }
  double affinity(const VD& p, int64_t i, int64_t j) const {  // sum_g p_ig p_jg + eps
    double a = 0;
    for (int64_t g = 0; g < s.groups; ++g) a += p[i * s.groups + g] * p[j * s.groups + g];
    return a + s.eps;
  }
  // Scores of row (i, h) into sc[0..i]; -inf where invisible.
  void scores(const VD& q, const VD& k, const VD& p, int64_t i, int64_t h, VD& sc) const {
    const int64_t hd = s.head_dim, kvh = h / (s.heads / s.kv_heads);
    for (int64_t j = 0; j <= i; ++j) {
      if (!visible(i, j)) {
        sc[j] = -INFINITY;
        continue;
      }
      double dot = 0;
      for (int64_t e = 0; e < hd; ++e) dot += q[(i * s.heads + h) * hd + e] * k[(j * s.kv_heads + kvh) * hd + e];
      sc[j] = s.scale * dot + (!p.empty() && biased(i, j) ? std::log(affinity(p, i, j)) : 0.0);
    }
  }
  void forward(const VD& q, const VD& k, const VD& v, const VD& p, VD& o, VD& lse) const {
    const int64_t n = s.n_q, H = s.heads, hd = s.head_dim, gs = s.heads / s.kv_heads;
    o.assign(n * H * hd, 0.0);
    lse.assign(H * n, 0.0);
    VD sc(n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        scores(q, k, p, i, h, sc);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, sc[j]);
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        lse[h * n + i] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) {
          const double w = std::exp(sc[j] - lse[h * n + i]);
          for (int64_t e = 0; e < hd; ++e) o[(i * H + h) * hd + e] += w * v[(j * s.kv_heads + h / gs) * hd + e];
        }
      }
  }
  // Analytic backward: dS_ij = P_ij (dO_i.v_j - sum_j' P_ij' dO_i.v_j'); dq, dk, dv as usual;
  // dp_ig += dS_ij p_jg / A_ij and dp_jg += dS_ij p_ig / A_ij on biased pairs (summed over heads).
  void backward(const VD& q, const VD& k, const VD& v, const VD& p, const VD& dout, VD& dq, VD& dk, VD& dv,
                VD& dp) const {
    const int64_t n = s.n_q, H = s.heads, KVH = s.kv_heads, hd = s.head_dim, gs = H / KVH, G = s.groups;
    dq.assign(n * H * hd, 0.0);
    dk.assign(n * KVH * hd, 0.0);
    dv.assign(n * KVH * hd, 0.0);
    dp.assign(p.empty() ? 0 : n * G, 0.0);
    VD sc(n), P(n), dP(n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kvh = h / gs;
        scores(q, k, p, i, h, sc);
        double mx = -INFINITY, sum = 0, dsum = 0;
        for (int64_t j = 0; j <= i; ++j) mx = std::max(mx, sc[j]);
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        for (int64_t j = 0; j <= i; ++j) {
          P[j] = std::exp(sc[j] - mx) / sum;
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += dout[(i * H + h) * hd + e] * v[(j * KVH + kvh) * hd + e];
          dP[j] = d;
          dsum += P[j] * d;
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double dS = P[j] * (dP[j] - dsum);
          for (int64_t e = 0; e < hd; ++e) {
            dq[(i * H + h) * hd + e] += s.scale * dS * k[(j * KVH + kvh) * hd + e];
            dk[(j * KVH + kvh) * hd + e] += s.scale * dS * q[(i * H + h) * hd + e];
            dv[(j * KVH + kvh) * hd + e] += P[j] * dout[(i * H + h) * hd + e];
          }
          if (!p.empty() && visible(i, j) && biased(i, j)) {
            const double a = affinity(p, i, j);
            for (int64_t g = 0; g < G; ++g) {
              dp[i * G + g] += dS * p[j * G + g] / a;
              dp[j * G + g] += dS * p[i * G + g] / a;
            }
          }
        }
      }
  }
};

struct Inputs {
  VF q, k, v, p, w;  // w: weights of the scalar loss L = sum(w * o)
};

Inputs make_inputs(const AttnShape& s, bool with_p, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Inputs in;
  in.q.resize(s.n_q * s.heads * s.head_dim);
  in.k.resize(s.n_q * s.kv_heads * s.head_dim);
  in.v.resize(in.k.size());
  in.w.resize(in.q.size());
  for (auto* t : {&in.q, &in.k, &in.v, &in.w})
    for (auto& x : *t) x = nd(rng);
  if (with_p) {  // rows of a softmax over random logits, as the router produces
    in.p.resize(s.n_q * s.groups);
    for (int64_t i = 0; i < s.n_q; ++i) {
      double sum = 0;
      for (int64_t g = 0; g < s.groups; ++g) sum += in.p[i * s.groups + g] = std::exp(2.f * nd(rng));
      for (int64_t g = 0; g < s.groups; ++g) in.p[i * s.groups + g] /= (float)sum;
    }
  }
  return in;
}

using focus::test::rel_err;
using focus::test::to_d;

AttnShape shape(int64_t n, int64_t H, int64_t KVH, int64_t hd, int64_t G, int64_t w, int64_t S) {
  AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = H;
  s.kv_heads = KVH;
  s.head_dim = hd;
  s.groups = G;
  s.local_window = w;
  s.sinks = S;
  s.scale = 1.f / std::sqrt((float)hd);
  return s;
}

// ---- float64: analytic backward against central differences ---------------------------------
void check_reference_gradients(const AttnShape& s, bool with_p, uint32_t seed) {
  const Inputs in = make_inputs(s, with_p, seed);
  const Ref ref{s};
  VD q = to_d(in.q), k = to_d(in.k), v = to_d(in.v), p = to_d(in.p), w = to_d(in.w);
  VD dq, dk, dv, dp;
  ref.backward(q, k, v, p, w, dq, dk, dv, dp);
  auto loss = [&] {
    VD o, lse;
    ref.forward(q, k, v, p, o, lse);
    double L = 0;
    for (size_t i = 0; i < o.size(); ++i) L += w[i] * o[i];
    return L;
  };
  const double h = 1e-5;
  auto numeric = [&](VD& x) {
    VD g(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const double x0 = x[i];
      x[i] = x0 + h;
      const double lp = loss();
      x[i] = x0 - h;
      const double lm = loss();
      x[i] = x0;
      g[i] = (lp - lm) / (2 * h);
    }
    return g;
  };
  const char* what = with_p ? "with bias" : "no bias";
  EXPECT_LT(rel_err(dq, numeric(q)), 1e-6) << "dq " << what;
  EXPECT_LT(rel_err(dk, numeric(k)), 1e-6) << "dk " << what;
  EXPECT_LT(rel_err(dv, numeric(v)), 1e-6) << "dv " << what;
  if (with_p) {
    const VD np = numeric(p);
    EXPECT_LT(rel_err(dp, np), 1e-6) << "dp";
    double mx = 0;
    for (double x : np) mx = std::max(mx, std::fabs(x));
    EXPECT_GT(mx, 1e-3) << "the bias gradient should not vanish in this case";
  }
}

// ---- fp32 kernel against the float64 reference ---------------------------------------------
void check_kernel(const AttnShape& s, bool with_p, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "n " << s.n_q << " H " << s.heads << "/" << s.kv_heads << " hd " << s.head_dim
                                    << " G " << s.groups << " w " << s.local_window << " S " << s.sinks << " sliding "
                                    << s.sliding_window << (with_p ? " bias" : " no bias"));
  const Inputs in = make_inputs(s, with_p, seed);
  const float* pp = with_p ? in.p.data() : nullptr;
  VF o(in.q.size()), lse(s.heads * s.n_q);
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), pp, o.data(), lse.data(), s);
  VF dq(in.q.size(), 0.f), dk(in.k.size(), 0.f), dv(in.v.size(), 0.f), dp(in.p.size(), 0.f);
  focus::cpu::soft_attention_backward(in.q.data(), in.k.data(), in.v.data(), pp, o.data(), lse.data(), in.w.data(),
                                 dq.data(), dk.data(), dv.data(), with_p ? dp.data() : nullptr, s);

  const Ref ref{s};
  const VD q = to_d(in.q), k = to_d(in.k), v = to_d(in.v), p = to_d(in.p), w = to_d(in.w);
  VD ro, rlse, rdq, rdk, rdv, rdp;
  ref.forward(q, k, v, p, ro, rlse);
  ref.backward(q, k, v, p, w, rdq, rdk, rdv, rdp);
  EXPECT_LT(rel_err(o, ro), 1e-5) << "o";
  double lse_err = 0;
  for (size_t i = 0; i < rlse.size(); ++i) lse_err = std::max(lse_err, std::fabs(lse[i] - rlse[i]));
  EXPECT_LT(lse_err, 1e-5) << "lse";
  EXPECT_LT(rel_err(dq, rdq), 1e-4) << "dq";
  EXPECT_LT(rel_err(dk, rdk), 1e-4) << "dk";
  EXPECT_LT(rel_err(dv, rdv), 1e-4) << "dv";
  if (with_p) {
    EXPECT_LT(rel_err(dp, rdp), 1e-4) << "dp";
  }
}

}  // namespace

TEST(SoftAttentionReference, BackwardMatchesFiniteDifferences) {
  check_reference_gradients(shape(7, 4, 2, 8, 4, 1, 2), true, 1);   // GQA, window 1, 2 sinks
  check_reference_gradients(shape(9, 4, 1, 5, 4, 1, 0), true, 2);   // MQA, odd head_dim
  check_reference_gradients(shape(20, 2, 2, 4, 1, 16, 0), true, 3); // G = 1, window 16
  check_reference_gradients(shape(20, 4, 2, 4, 3, 16, 2), true, 4); // window 16, sinks
  check_reference_gradients(shape(6, 4, 2, 8, 4, 0, 0), true, 5);   // window 0: every pair biased
  check_reference_gradients(shape(9, 4, 2, 8, 4, 1, 0), false, 6);  // no bias
  AttnShape sw = shape(12, 2, 1, 4, 4, 2, 1);
  sw.sliding_window = 5;  // sliding-window layer
  check_reference_gradients(sw, true, 7);
}

TEST(SoftAttentionKernel, MatchesReferenceAcrossShapes) {
  uint32_t seed = 100;
  for (int64_t n : {1, 7, 65, 130})
    for (int64_t w : {1, 16})
      for (int64_t S : {0, 2})
        for (auto [H, KVH] : {std::pair<int64_t, int64_t>{4, 2}, {4, 1}})
          for (int64_t G : {1, 4}) check_kernel(shape(n, H, KVH, n == 65 ? 64 : 20, G, w, S), true, ++seed);
}

TEST(SoftAttentionKernel, NoBiasAndEdgeShapes) {
  for (int64_t n : {1, 7, 65, 130}) check_kernel(shape(n, 4, 2, 20, 4, 16, 0), false, 200 + n);
  check_kernel(shape(130, 3, 3, 64, 16, 0, 0), true, 301);   // MHA, window 0, G = 16
  check_kernel(shape(129, 8, 1, 80, 5, 64, 1), true, 302);   // MQA 8/1, head_dim 80, window = tile
  check_kernel(shape(200, 2, 1, 8, 20, 100, 3), true, 303);  // G > 16 (two vectors), tiny head_dim
  AttnShape sw = shape(200, 4, 2, 16, 4, 8, 2);
  sw.sliding_window = 70;
  check_kernel(sw, true, 304);
  sw.sliding_window = 1;
  check_kernel(sw, false, 305);
}

TEST(SoftAttentionKernel, WithoutBiasEqualsDenseFlashKernel) {
  for (int64_t n : {1, 7, 65, 130, 300})
    for (int64_t sliding : {0, 16, 100}) {
      AttnShape s = shape(n, 4, 2, 64, 4, 16, 2);
      s.sliding_window = sliding;
      const Inputs in = make_inputs(s, false, 400 + n);
      VF o1(in.q.size()), o2(in.q.size()), l1(4 * n), l2(4 * n);
      focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), nullptr, o1.data(), l1.data(), s);
      const focus::cpu::AttnShape a{n, n, 0, 4, 2, 64, 4 * 64, 2 * 64, 4 * 64, s.scale, sliding};
      focus::cpu::flash_attention(in.q.data(), in.k.data(), in.v.data(), o2.data(), l2.data(), a);
      for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 1e-6) << "n " << n << " sliding " << sliding;
      for (size_t i = 0; i < l1.size(); ++i) ASSERT_NEAR(l1[i], l2[i], 1e-6) << "n " << n << " sliding " << sliding;
    }
}

TEST(SoftAttentionKernel, CausalExactly) {
  // Changing q/k/v/p of tokens after i leaves o and lse at positions <= i bit-for-bit unchanged.
  const AttnShape s = shape(150, 4, 2, 32, 4, 16, 2);
  const Inputs base = make_inputs(s, true, 500);
  VF o0(base.q.size()), l0(4 * s.n_q);
  focus::cpu::soft_attention_forward(base.q.data(), base.k.data(), base.v.data(), base.p.data(), o0.data(), l0.data(), s);
  std::mt19937 rng(501);
  std::normal_distribution<float> nd(0.f, 3.f);
  for (int64_t i : {0, 5, 63, 64, 100, 148}) {
    Inputs in = base;
    const int64_t qs = s.heads * s.head_dim, ks = s.kv_heads * s.head_dim;
    for (int64_t j = i + 1; j < s.n_q; ++j) {
      for (int64_t e = 0; e < qs; ++e) in.q[j * qs + e] = nd(rng);
      for (int64_t e = 0; e < ks; ++e) in.k[j * ks + e] = nd(rng), in.v[j * ks + e] = nd(rng);
      for (int64_t g = 0; g < s.groups; ++g) in.p[j * s.groups + g] = std::fabs(nd(rng));
    }
    VF o(base.q.size()), l(4 * s.n_q);
    focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o.data(), l.data(), s);
    EXPECT_EQ(0, std::memcmp(o.data(), o0.data(), (i + 1) * qs * sizeof(float))) << "outputs up to " << i;
    for (int64_t h = 0; h < s.heads; ++h)
      EXPECT_EQ(0, std::memcmp(l.data() + h * s.n_q, l0.data() + h * s.n_q, (i + 1) * sizeof(float))) << "lse up to " << i;
  }
}

TEST(SoftAttentionKernel, BackwardIsDeterministicAndAccumulates) {
  const AttnShape s = shape(300, 4, 2, 64, 4, 16, 2);
  const Inputs in = make_inputs(s, true, 600);
  VF o(in.q.size()), lse(4 * s.n_q);
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o.data(), lse.data(), s);
  auto run = [&](float init) {
    std::vector<VF> g{VF(in.q.size(), init), VF(in.k.size(), init), VF(in.v.size(), init), VF(in.p.size(), init)};
    focus::cpu::soft_attention_backward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o.data(), lse.data(),
                                   in.w.data(), g[0].data(), g[1].data(), g[2].data(), g[3].data(), s);
    return g;
  };
  const auto a = run(0.f), b = run(0.f), c = run(1.f);
  for (int t = 0; t < 4; ++t) {
    EXPECT_EQ(0, std::memcmp(a[t].data(), b[t].data(), a[t].size() * sizeof(float))) << "tensor " << t;
    for (size_t i = 0; i < a[t].size(); ++i) ASSERT_NEAR(c[t][i], a[t][i] + 1.f, 1e-5) << "tensor " << t;
  }
}

TEST(SoftAttentionKernel, RejectsBadShapes) {
  VF x(64, 0.1f), o(64);
  AttnShape s = shape(2, 3, 2, 8, 4, 1, 0);  // 3 heads over 2 kv heads
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), nullptr, o.data(), nullptr, s),
               focus::Error);
  s = shape(2, 2, 1, 8, 0, 1, 0);  // p given with G = 0
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), x.data(), o.data(), nullptr, s),
               focus::Error);
  s = shape(2, 2, 1, 8, 4, -1, 0);
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), nullptr, o.data(), nullptr, s),
               focus::Error);
  s = shape(2, 2, 1, 8, 4, 1, 0);
  VF bad_p(8, 0.25f);
  bad_p[5] = -0.1f;  // probabilities must be non-negative
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), bad_p.data(), o.data(), nullptr, s),
               focus::Error);
}


// ---- asymmetric memberships: queries p [RH, N, G], keys pk [RH, N, G], router r serving kv heads
// r * KVH / RH ..; a float64 reference checked against central differences, then the kernel.
namespace {

struct AsymRef {
  AttnShape s;
  int64_t rh = 1;
  // The hybrid pattern: head h of row i reads the blocks set in bits [H, n, words] (blocks of bs
  // keys); such a far pair weighs exp(eq[r, i] + ek[r, j]) (eq, ek [RH, n], empty: 0).
  const std::vector<uint64_t>* bits = nullptr;
  int64_t bs = 0, words = 0;
  // The group switch: a head whose entry is 0 reads its blocks alone (empty: every head reads groups).
  std::vector<int64_t> head_groups;
  bool groups_of(int64_t h) const { return head_groups.empty() || head_groups[h] != 0; }
  int64_t router(int64_t h) const { return (h / (s.heads / s.kv_heads)) / (s.kv_heads / rh); }
  bool block_reads(int64_t h, int64_t i, int64_t j) const {
    if (!bits) return false;
    const int64_t b = j / bs;
    return ((*bits)[(h * s.n_q + i) * words + b / 64] >> (b % 64)) & 1u;
  }
  double affinity(const VD& p, const VD& pk, int64_t r, int64_t i, int64_t j) const {
    double a = 0;
    for (int64_t g = 0; g < s.groups; ++g) a += p[(r * s.n_q + i) * s.groups + g] * pk[(r * s.n_q + j) * s.groups + g];
    return a + s.eps;
  }
  double term(const VD& e, int64_t r, int64_t i) const { return e.empty() ? 0.0 : e[r * s.n_q + i]; }
  bool biased(int64_t i, int64_t j) const { return i - j >= s.local_window && j >= s.sinks; }
  // L = sum(w * o); fills the gradients when asked.
  double run(const VD& q, const VD& k, const VD& v, const VD& p, const VD& pk, const VD& w, const VD& eq,
             const VD& ek, VD* dp, VD* dpk, VD* deq, VD* dek, VD* o_out = nullptr) const {
    const int64_t n = s.n_q, H = s.heads, KVH = s.kv_heads, hd = s.head_dim, gs = H / KVH, G = s.groups;
    if (dp) dp->assign(p.size(), 0.0), dpk->assign(pk.size(), 0.0);
    if (deq) deq->assign(rh * n, 0.0), dek->assign(rh * n, 0.0);
    // The pair's A + eps, and whether a block reads it.
    auto weight = [&](int64_t h, int64_t r, int64_t i, int64_t j, bool* blk) {
      *blk = block_reads(h, i, j);
      if (*blk) return std::exp(term(eq, r, i) + term(ek, r, j)) + s.eps;
      return groups_of(h) ? affinity(p, pk, r, i, j) : (double)s.eps;
    };
    if (o_out) o_out->assign(n * H * hd, 0.0);
    double L = 0;
    VD sc(n), P(n), dP(n);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kvh = h / gs, r = router(h);
        double mx = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e) dot += q[(i * H + h) * hd + e] * k[(j * KVH + kvh) * hd + e];
          bool blk = false;
          sc[j] = s.scale * dot + (biased(i, j) ? std::log(weight(h, r, i, j, &blk)) : 0.0);
          mx = std::max(mx, sc[j]);
        }
        double sum = 0, dsum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        for (int64_t j = 0; j <= i; ++j) {
          P[j] = std::exp(sc[j] - mx) / sum;
          double d = 0;
          for (int64_t e = 0; e < hd; ++e) d += w[(i * H + h) * hd + e] * v[(j * KVH + kvh) * hd + e];
          dP[j] = d;
          dsum += P[j] * d;
          L += P[j] * d;
          if (o_out)
            for (int64_t e = 0; e < hd; ++e) (*o_out)[(i * H + h) * hd + e] += P[j] * v[(j * KVH + kvh) * hd + e];
        }
        if (!dp) continue;
        for (int64_t j = 0; j <= i; ++j) {
          if (!biased(i, j)) continue;
          bool blk = false;
          const double a = weight(h, r, i, j, &blk);
          const double dA = P[j] * (dP[j] - dsum) / a;
          if (blk) {
            if (deq) (*deq)[r * n + i] += dA * (a - s.eps), (*dek)[r * n + j] += dA * (a - s.eps);
            continue;
          }
          if (!groups_of(h)) continue;  // the pair is masked whatever the memberships
          for (int64_t g = 0; g < G; ++g) {
            (*dp)[(r * n + i) * G + g] += dA * pk[(r * n + j) * G + g];
            (*dpk)[(r * n + j) * G + g] += dA * p[(r * n + i) * G + g];
          }
        }
      }
    return L;
  }
};

VF random_memberships(int64_t rows, int64_t G, std::mt19937& rng, bool one_hot) {
  std::normal_distribution<float> nd(0.f, 1.f);
  VF m(rows * G, 0.f);
  for (int64_t i = 0; i < rows; ++i) {
    if (one_hot) {
      m[i * G + rng() % G] = 1.f;
      continue;
    }
    double sum = 0;
    for (int64_t g = 0; g < G; ++g) sum += m[i * G + g] = std::exp(2.f * nd(rng));
    for (int64_t g = 0; g < G; ++g) m[i * G + g] /= (float)sum;
  }
  return m;
}

// Memberships p (queries) and pk (keys) of RH routers, one-hot or soft; with bs > 0 also the hybrid
// pattern: blocks of bs keys read by each (head, row) with probability 0.3, with far-pair terms or
// without, and with `switched` the group switch (every other head reads its blocks alone). The
// reference against central differences (small cases), then the kernel against it.
void check_asymmetric(const AttnShape& s, int64_t RH, bool one_hot, uint32_t seed, bool finite_differences,
                      int64_t bs = 0, bool terms = false, bool switched = false) {
  SCOPED_TRACE(::testing::Message() << "n " << s.n_q << " H " << s.heads << "/" << s.kv_heads << " RH " << RH << " G "
                                    << s.groups << " blocks of " << bs << (terms ? " terms" : "")
                                    << (one_hot ? " one-hot" : " soft") << (switched ? " switched" : ""));
  const Inputs in = make_inputs(s, false, seed);
  std::mt19937 rng(seed + 7);
  const VF p = random_memberships(RH * s.n_q, s.groups, rng, one_hot), pk = random_memberships(RH * s.n_q, s.groups, rng, one_hot);
  const int64_t nblocks = bs > 0 ? (s.n_q + bs - 1) / bs : 0, words = (nblocks + 63) / 64;
  std::vector<uint64_t> bits(s.heads * s.n_q * words, 0);
  for (int64_t hi = 0; hi < s.heads * s.n_q; ++hi)
    for (int64_t b = 0; b < nblocks; ++b)
      if (rng() % 10 < 3) bits[hi * words + b / 64] |= uint64_t{1} << (b % 64);
  VF eq, ek;
  if (terms) {
    std::normal_distribution<float> nd(0.f, 0.7f);
    for (int64_t x = 0; x < RH * s.n_q; ++x) eq.push_back(nd(rng)), ek.push_back(nd(rng));
  }
  AsymRef ref{s, RH};
  ref.bits = bs > 0 ? &bits : nullptr;
  ref.bs = bs;
  ref.words = words;
  if (switched)
    for (int64_t h = 0; h < s.heads; ++h) ref.head_groups.push_back(h % 2);
  VD q = to_d(in.q), k = to_d(in.k), v = to_d(in.v), w = to_d(in.w), pd = to_d(p), pkd = to_d(pk);
  VD eqd = to_d(eq), ekd = to_d(ek);
  VD rdp, rdpk, rdeq, rdek, ro;
  ref.run(q, k, v, pd, pkd, w, eqd, ekd, &rdp, &rdpk, &rdeq, &rdek, &ro);
  if (finite_differences) {
    auto numeric = [&](VD& x) {
      VD g(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i], h = 1e-6 * std::max(1.0, std::fabs(x0));
        x[i] = x0 + h;
        const double lp = ref.run(q, k, v, pd, pkd, w, eqd, ekd, nullptr, nullptr, nullptr, nullptr);
        x[i] = x0 - h;
        const double lm = ref.run(q, k, v, pd, pkd, w, eqd, ekd, nullptr, nullptr, nullptr, nullptr);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * h);
      }
      return g;
    };
    EXPECT_LT(rel_err(rdp, numeric(pd)), 1e-5) << "reference dp";
    EXPECT_LT(rel_err(rdpk, numeric(pkd)), 1e-5) << "reference dpk";
    if (terms) {
      EXPECT_LT(rel_err(rdeq, numeric(eqd)), 1e-5) << "reference deq";
      EXPECT_LT(rel_err(rdek, numeric(ekd)), 1e-5) << "reference dek";
    }
  }
  VF o(in.q.size()), lse(s.heads * s.n_q), dq(in.q.size(), 0.f), dk(in.k.size(), 0.f), dv(in.v.size(), 0.f);
  VF dp(p.size(), 0.f), dpk(pk.size(), 0.f), deq(RH * s.n_q, 0.f), dek(RH * s.n_q, 0.f);
  focus::cpu::SoftKeys keys{pk.data(), dpk.data(), RH};
  keys.block_bits = bs > 0 ? bits.data() : nullptr;
  keys.block_size = bs;
  keys.block_words = words;
  keys.eq = terms ? eq.data() : nullptr;
  keys.ek = terms ? ek.data() : nullptr;
  keys.deq = deq.data();
  keys.dek = dek.data();
  keys.head_groups = switched ? ref.head_groups.data() : nullptr;
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), p.data(), o.data(), lse.data(), s, keys);
  focus::cpu::soft_attention_backward(in.q.data(), in.k.data(), in.v.data(), p.data(), o.data(), lse.data(),
                                      in.w.data(), dq.data(), dk.data(), dv.data(), dp.data(), s, keys);
  EXPECT_LT(rel_err(o, ro), 1e-5) << "o";
  EXPECT_LT(rel_err(dp, rdp), 1e-4) << "dp";
  EXPECT_LT(rel_err(dpk, rdpk), 1e-4) << "dpk";
  EXPECT_LT(rel_err(deq, rdeq), 1e-4) << "deq";
  EXPECT_LT(rel_err(dek, rdek), 1e-4) << "dek";
  double mx = 0;
  for (double x : rdpk) mx = std::max(mx, std::fabs(x));
  EXPECT_GT(mx, 1e-4) << "the keys' gradient should not vanish in this case";
  if (bs == 0) return;
  mx = 0;
  for (double x : rdeq) mx = std::max(mx, std::fabs(x));
  EXPECT_GT(mx, 1e-4) << "the terms' gradient through the blocks should not vanish in this case";
  // The blocks change the result: without them the output differs.
  VF o2(in.q.size());
  const focus::cpu::SoftKeys plain{pk.data(), nullptr, RH};
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), p.data(), o2.data(), nullptr, s, plain);
  EXPECT_GT(rel_err(o2, ro), 1e-3) << "blocks read nothing in this case";
  if (!switched) return;
  // The switch changes the result: with every head reading its groups the output differs, and
  // the heads without groups give the memberships nothing (one head of each kv group reads them).
  VF o3(in.q.size());
  focus::cpu::SoftKeys all = keys;
  all.head_groups = nullptr;
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), p.data(), o3.data(), nullptr, s, all);
  EXPECT_GT(rel_err(o3, ro), 1e-3) << "the switch changes nothing in this case";
}

}  // namespace

TEST(SoftAttentionHybrid, ReferenceMatchesFiniteDifferencesAndKernelMatchesReference) {
  AttnShape hard = shape(11, 2, 2, 4, 3, 1, 1);
  hard.eps = 1e-3f;  // 0/1 memberships: the hard pattern with a masked pair at weight eps
  check_asymmetric(hard, 2, true, 720, true, 2, true);
  check_asymmetric(shape(9, 4, 2, 8, 4, 2, 0), 1, false, 721, true, 3, true);   // one router, blocks of 3
  check_asymmetric(shape(9, 4, 2, 8, 4, 1, 1), 2, false, 722, true, 1, false);  // no terms, blocks of 1
  check_asymmetric(shape(130, 6, 3, 16, 5, 16, 2), 3, false, 723, false, 4, true);
  AttnShape hard2 = shape(200, 4, 2, 32, 8, 64, 1);
  hard2.eps = 1e-7f;
  check_asymmetric(hard2, 2, true, 724, false, 16, true);
  check_asymmetric(shape(300, 9, 3, 16, 16, 40, 1), 3, true, 725, false, 5, true);  // blocks across tile edges
}

// The group switch: every other head reads its blocks alone (the far pairs outside them masked,
// no gradient from them to the memberships), against the reference and central differences.
TEST(SoftAttentionHybrid, HeadsWithoutGroupsMatchReference) {
  AttnShape hard = shape(11, 2, 2, 4, 3, 1, 1);
  hard.eps = 1e-3f;
  check_asymmetric(hard, 2, true, 730, true, 2, true, true);
  check_asymmetric(shape(9, 4, 2, 8, 4, 2, 0), 1, false, 731, true, 3, true, true);
  check_asymmetric(shape(9, 4, 1, 8, 4, 1, 1), 1, false, 732, true, 1, false, true);  // one kv head, no terms
  AttnShape hard2 = shape(200, 4, 2, 32, 8, 64, 1);
  hard2.eps = 1e-7f;
  check_asymmetric(hard2, 2, true, 733, false, 16, true, true);
  check_asymmetric(shape(300, 9, 3, 16, 16, 40, 1), 3, true, 734, false, 5, true, true);
}

TEST(SoftAttentionAsymmetric, ReferenceMatchesFiniteDifferencesAndKernelMatchesReference) {
  check_asymmetric(shape(9, 4, 2, 8, 4, 1, 1), 2, false, 700, true);   // a router per kv head
  check_asymmetric(shape(9, 4, 2, 8, 4, 2, 0), 1, false, 701, true);   // one router, distinct key side
  AttnShape hard = shape(11, 2, 2, 4, 3, 1, 1);
  hard.eps = 1e-3f;  // 0/1 memberships: the hard pattern with a masked pair at weight eps
  check_asymmetric(hard, 2, true, 702, true);
  check_asymmetric(shape(130, 6, 3, 16, 5, 16, 2), 3, false, 703, false);
  AttnShape hard2 = shape(200, 4, 2, 32, 8, 64, 1);
  hard2.eps = 1e-7f;
  check_asymmetric(hard2, 2, true, 704, false);
}

TEST(SoftAttentionAsymmetric, SharedKeysEqualTheSymmetricForm) {
  // pk == p with one router: the same outputs and the same total membership gradient.
  const AttnShape s = shape(130, 4, 2, 16, 4, 16, 2);
  const Inputs in = make_inputs(s, true, 710);
  VF o1(in.q.size()), o2(in.q.size()), l1(4 * s.n_q), l2(4 * s.n_q);
  VF g1(in.p.size(), 0.f), gq(in.p.size(), 0.f), gk(in.p.size(), 0.f), d(in.q.size() + in.k.size() * 4, 0.f);
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o1.data(), l1.data(), s);
  const focus::cpu::SoftKeys keys{in.p.data(), gk.data(), 1};
  focus::cpu::soft_attention_forward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o2.data(), l2.data(), s, keys);
  EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.size() * sizeof(float)));
  VF dq(in.q.size(), 0.f), dk(in.k.size(), 0.f), dv(in.k.size(), 0.f);
  focus::cpu::soft_attention_backward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o1.data(), l1.data(),
                                      in.w.data(), dq.data(), dk.data(), dv.data(), g1.data(), s);
  focus::cpu::soft_attention_backward(in.q.data(), in.k.data(), in.v.data(), in.p.data(), o1.data(), l1.data(),
                                      in.w.data(), dq.data(), dk.data(), dv.data(), gq.data(), s, keys);
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(g1[i], gq[i] + gk[i], 1e-5 * (1 + std::fabs(g1[i]))) << i;
}

TEST(SoftAttentionAsymmetric, RejectsBadRouterCounts) {
  VF x(64 * 4, 0.1f), o(64 * 4), pk(64, 0.25f);
  const AttnShape s = shape(2, 4, 2, 8, 4, 1, 0);
  const focus::cpu::SoftKeys three{pk.data(), nullptr, 3};  // 3 routers over 2 kv heads
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), x.data(), o.data(), nullptr, s, three),
               focus::Error);
  const focus::cpu::SoftKeys no_keys{nullptr, nullptr, 2};  // several routers need the keys' side
  EXPECT_THROW(focus::cpu::soft_attention_forward(x.data(), x.data(), x.data(), x.data(), o.data(), nullptr, s, no_keys),
               focus::Error);
}
