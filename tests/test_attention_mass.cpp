// Attention mass by key group (router distillation targets):
//  - the fp32 tiled kernels against a float64 brute force built from explicit softmax rows, given
//    flash_attention's lse and given the float64 lse rounded to float;
//  - the backward is the exact transpose of the forward (<dM, F(X)> == <B(dM), X>);
//  - the far mass plus the diagonal is the whole row (1), X = ones gives far, and the bits do not
//    depend on the thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_mass.h"
#include "test_util.h"

using focus::cpu::AttnShape;
using focus::cpu::MassHeads;

namespace {

using VD = std::vector<double>;
using VF = std::vector<float>;
using focus::test::rel_err;

AttnShape shape(int64_t n, int64_t H, int64_t KVH, int64_t hd, int64_t w, int64_t S) {
  AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = H;
  s.kv_heads = KVH;
  s.head_dim = hd;
  s.local_window = w;
  s.sinks = S;
  s.scale = 1.f / std::sqrt((float)hd);
  s.q_stride = s.o_stride = H * hd;  // flash_attention takes the strides as given
  s.kv_stride = KVH * hd;
  return s;
}

struct Case {
  AttnShape s;
  VF q, k, v, lse;  // lse: flash_attention's
};

// q scaled up so that rows are peaked (scores of a few units), as in trained models.
Case make_case(const AttnShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Case c{s, VF(s.n_q * s.heads * s.head_dim), VF(s.n_q * s.kv_heads * s.head_dim), {}, VF(s.heads * s.n_q)};
  c.v.resize(c.k.size());
  for (auto& x : c.q) x = 2.5f * nd(rng);
  for (auto* t : {&c.k, &c.v})
    for (auto& x : *t) x = nd(rng);
  VF o(c.q.size());
  focus::cpu::flash_attention(c.q.data(), c.k.data(), c.v.data(), o.data(), c.lse.data(), s);
  return c;
}

// Rows of a soft assignment (softmax of random logits) or, with hard, one-hot rows.
VF make_assignment(int64_t n, int64_t C, bool hard, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  VF x(n * C, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    if (hard) {
      x[j * C + rng() % C] = 1.f;
      continue;
    }
    double sum = 0;
    for (int64_t g = 0; g < C; ++g) sum += x[j * C + g] = std::exp(2.f * nd(rng));
    for (int64_t g = 0; g < C; ++g) x[j * C + g] /= (float)sum;
  }
  return x;
}

VF make_normal(size_t size, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  VF x(size);
  for (auto& e : x) e = nd(rng);
  return x;
}

// ---- float64 brute force ---------------------------------------------------------------------
// A[h][i][j] from explicit softmax rows over j <= i, normalised in float64.
struct Ref {
  AttnShape s;
  VD A;  // [H, n, n], zero above the diagonal
  explicit Ref(const Case& c) : s(c.s), A(s.heads * s.n_q * s.n_q, 0.0) {
    const int64_t n = s.n_q, hd = s.head_dim, gs = s.heads / s.kv_heads;
    VD sc(n);
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e)
            dot += (double)c.q[(i * s.heads + h) * hd + e] * c.k[(j * s.kv_heads + h / gs) * hd + e];
          sc[j] = (double)s.scale * dot;
          mx = std::max(mx, sc[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        for (int64_t j = 0; j <= i; ++j) A[(h * n + i) * n + j] = std::exp(sc[j] - mx) / sum;
      }
  }
  // The float64 lse, for the kernel run on it.
  VF lse(const Case& c) const {
    const int64_t n = s.n_q, hd = s.head_dim, gs = s.heads / s.kv_heads;
    VF out(s.heads * n);
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t i = 0; i < n; ++i) {
        double mx = -INFINITY, sum = 0;
        VD sc(i + 1);
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < hd; ++e)
            dot += (double)c.q[(i * s.heads + h) * hd + e] * c.k[(j * s.kv_heads + h / gs) * hd + e];
          mx = std::max(mx, sc[j] = (double)s.scale * dot);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sc[j] - mx);
        out[h * n + i] = (float)(mx + std::log(sum));
      }
    return out;
  }
  std::vector<uint8_t> out;  // [H, n, n] pairs left out (MassExclusion), or empty
  bool is_far(int64_t i, int64_t j) const { return j <= i - s.local_window && j >= s.sinks; }
  int64_t rows(MassHeads m) const { return m == MassHeads::Mean ? 1 : s.kv_heads; }
  // Mean over the heads of output row r of A^h_ij (0 unless far).
  double a(MassHeads m, int64_t r, int64_t i, int64_t j) const {
    if (!is_far(i, j)) return 0.0;
    const int64_t hpr = s.heads / rows(m), n = s.n_q;
    double sum = 0;
    for (int64_t h = r * hpr; h < (r + 1) * hpr; ++h)
      if (out.empty() || !out[(h * n + i) * n + j]) sum += A[(h * n + i) * n + j];
    return sum / hpr;
  }
  void forward(MassHeads m, const VF& X, int64_t C, VD& M, VD& far) const {
    const int64_t n = s.n_q, R = rows(m);
    M.assign(n * R * C, 0.0);
    far.assign(n * R, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j <= i; ++j) {
          const double p = a(m, r, i, j);
          far[i * R + r] += p;
          for (int64_t g = 0; g < C; ++g) M[(i * R + r) * C + g] += p * X[j * C + g];
        }
  }
  VD backward(MassHeads m, const VF& dM, int64_t C) const {
    const int64_t n = s.n_q, R = rows(m);
    VD dX(n * C, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j <= i; ++j) {
          const double p = a(m, r, i, j);
          for (int64_t g = 0; g < C; ++g) dX[j * C + g] += p * dM[(i * R + r) * C + g];
        }
    return dX;
  }
};

struct Out {
  VF M, far, dX;
};

Out run_kernels(const Case& c, const VF& lse, MassHeads m, const VF& X, const VF& dM, int64_t C,
                const focus::cpu::MassExclusion* ex = nullptr) {
  const int64_t R = m == MassHeads::Mean ? 1 : c.s.kv_heads, n = c.s.n_q;
  Out o{VF(n * R * C, -7.f), VF(n * R, -7.f), VF(n * C, 0.f)};  // M and far are written, dX accumulated
  focus::cpu::attention_mass_forward(c.q.data(), c.k.data(), lse.data(), X.data(), C, c.s, m, o.M.data(),
                                     o.far.data(), ex);
  focus::cpu::attention_mass_backward(c.q.data(), c.k.data(), lse.data(), dM.data(), C, c.s, m, o.dX.data(), ex);
  return o;
}

// Tolerance of the kernels against float64, relative to the largest reference entry: the fp32
// score and lse of a pair are each off by ~|s| eps = 20 * 6e-8 ~ 1e-6 (scores here reach ~20) and
// the exponential by 2e-7, so a probability is off by <~ 3e-6 relative; the fp32 sums over the
// keys (tile FMA chains, then tile after tile) add a few eps of the row total. Measured: 3e-6.
constexpr double kTol = 2e-5;

void check_case(const AttnShape& s, int64_t C, bool hard, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << "n " << s.n_q << " H " << s.heads << "/" << s.kv_heads << " hd " << s.head_dim
                                    << " w " << s.local_window << " S " << s.sinks << " C " << C
                                    << (hard ? " one-hot" : " soft"));
  const Case c = make_case(s, seed);
  const Ref ref(c);
  const VF X = make_assignment(s.n_q, C, hard, seed + 1);
  const VF lse64 = ref.lse(c);
  for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead}) {
    SCOPED_TRACE(m == MassHeads::Mean ? "mean over heads" : "per kv head");
    const VF dM = make_normal(s.n_q * ref.rows(m) * C, seed + 2);
    VD rM, rfar;
    ref.forward(m, X, C, rM, rfar);
    const VD rdX = ref.backward(m, dM, C);
    for (const VF* lse : {&c.lse, &lse64}) {
      SCOPED_TRACE(lse == &c.lse ? "flash lse" : "float64 lse");
      const Out o = run_kernels(c, *lse, m, X, dM, C);
      EXPECT_LT(rel_err(o.M, rM), kTol) << "M";
      EXPECT_LT(rel_err(o.far, rfar), kTol) << "far";
      EXPECT_LT(rel_err(o.dX, rdX), kTol) << "dX";
    }
  }
}

}  // namespace

TEST(AttentionMassKernel, MatchesFloat64ReferenceAcrossShapes) {
  // Head layouts and C cycle through the (n, w, S) grid, with head_dim 64 (one full tile row of
  // vectors) and 20 (padded).
  const std::pair<int64_t, int64_t> layouts[] = {{4, 4}, {6, 2}, {4, 1}};
  const int64_t Cs[] = {1, 4, 16};
  uint32_t seed = 1000, idx = 0;
  for (int64_t n : {1, 17, 64, 130, 333})
    for (int64_t w : {1, 8, 70})
      for (int64_t S : {0, 1, 3}) {
        const auto [H, KVH] = layouts[idx % 3];
        const int64_t C = Cs[(idx / 3) % 3];
        check_case(shape(n, H, KVH, idx % 2 ? 64 : 20, w, S), C, idx % 4 == 3, seed += 10);
        ++idx;
      }
}

TEST(AttentionMassKernel, EveryLayoutAndGroupCount) {
  uint32_t seed = 2000;
  for (auto [H, KVH] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {6, 1}})
    for (int64_t C : {1, 4, 16}) check_case(shape(130, H, KVH, 16, 8, 1), C, C == 4, seed += 10);
}

TEST(AttentionMassKernel, LeftOutPairsMatchFloat64Reference) {
  // Random pairs left out per head (a third of them, some rows with every bit of a word set, bits
  // on pairs that are not far anyway), against the brute force that skips the same pairs.
  uint32_t seed = 2500;
  for (int64_t n : {17, 130, 333})
    for (auto [H, KVH] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {4, 1}}) {
      const AttnShape s = shape(n, H, KVH, 32, n == 17 ? 3 : 20, 1);
      const int64_t C = 4, words = (n + 63) / 64;
      const Case c = make_case(s, seed += 10);
      Ref ref(c);
      std::mt19937 rng(seed);
      ref.out.assign(H * n * n, 0);
      std::vector<uint64_t> by_row(H * n * words, 0), by_key(H * n * words, 0);
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < n; ++i) {
          const bool all = rng() % 16 == 0;
          for (int64_t j = 0; j < n; ++j)
            if (all || rng() % 3 == 0) {
              ref.out[(h * n + i) * n + j] = 1;
              by_row[(h * n + i) * words + j / 64] |= uint64_t{1} << (j % 64);
              by_key[(h * n + j) * words + i / 64] |= uint64_t{1} << (i % 64);
            }
        }
      const focus::cpu::MassExclusion ex{by_row.data(), by_key.data(), words};
      const VF X = make_assignment(n, C, false, seed + 1);
      for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead}) {
        SCOPED_TRACE(::testing::Message() << "n " << n << " H " << H << "/" << KVH
                                          << (m == MassHeads::Mean ? " mean" : " per kv head"));
        const VF dM = make_normal(n * ref.rows(m) * C, seed + 2);
        VD rM, rfar;
        ref.forward(m, X, C, rM, rfar);
        const VD rdX = ref.backward(m, dM, C);
        const Out o = run_kernels(c, c.lse, m, X, dM, C, &ex);
        EXPECT_LT(rel_err(o.M, rM), kTol) << "M";
        EXPECT_LT(rel_err(o.far, rfar), kTol) << "far";
        EXPECT_LT(rel_err(o.dX, rdX), kTol) << "dX";
        // And the exclusion did something: without it the far mass is larger.
        const Out full = run_kernels(c, c.lse, m, X, dM, C);
        double with = 0, without = 0;
        for (int64_t i = 0; i < (int64_t)o.far.size(); ++i) with += o.far[i], without += full.far[i];
        if (n > 17) {
          EXPECT_LT(with, 0.8 * without);
        }
      }
    }
}

TEST(AttentionMassKernel, BackwardIsTheTranspose) {
  // <dM, F(X)> == <B(dM), X> for random (signed) X and dM: the two kernels compute the same fp32
  // probabilities (same scores, same exponential) and differ only in the order of the sums, so
  // the two sides agree to ~1e-6 of sum |dM| |M|.
  uint32_t seed = 3000;
  for (int64_t n : {17, 130, 333})
    for (auto [H, KVH] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {4, 1}})
      for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead}) {
        const AttnShape s = shape(n, H, KVH, 32, n == 17 ? 3 : 20, 1);
        const int64_t C = 4, R = m == MassHeads::Mean ? 1 : KVH;
        const Case c = make_case(s, seed += 10);
        const VF X = make_normal(n * C, seed + 1), dM = make_normal(n * R * C, seed + 2);
        const Out o = run_kernels(c, c.lse, m, X, dM, C);
        double lhs = 0, rhs = 0, mag = 0;
        for (size_t i = 0; i < dM.size(); ++i) lhs += (double)dM[i] * o.M[i], mag += std::fabs((double)dM[i] * o.M[i]);
        for (size_t j = 0; j < X.size(); ++j) rhs += (double)o.dX[j] * X[j];
        EXPECT_LT(std::fabs(lhs - rhs), 1e-6 * mag) << "n " << n << " H " << H << "/" << KVH << " lhs " << lhs
                                                     << " rhs " << rhs;
        EXPECT_GT(mag, 1.0);
      }
}

TEST(AttentionMassKernel, FarPlusDiagonalIsTheWholeRow) {
  // With w = 1 and no sinks every key but the query's own is far: far[i] + mean_h A^h_ii = 1,
  // with the kernel given flash_attention's lse (A_ii from the float64 softmax rows).
  for (auto [H, KVH] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}})
    for (int64_t n : {1, 64, 333}) {
      const AttnShape s = shape(n, H, KVH, 64, 1, 0);
      const Case c = make_case(s, 4000 + (uint32_t)n);
      const Ref ref(c);
      for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead}) {
        const int64_t R = ref.rows(m), hpr = H / R;
        VF far(n * R);
        focus::cpu::attention_mass_forward(c.q.data(), c.k.data(), c.lse.data(), nullptr, 0, s, m, nullptr,
                                           far.data());
        for (int64_t i = 0; i < n; ++i)
          for (int64_t r = 0; r < R; ++r) {
            double diag = 0;
            for (int64_t h = r * hpr; h < (r + 1) * hpr; ++h) diag += ref.A[(h * n + i) * n + i] / hpr;
            ASSERT_NEAR(far[i * R + r] + diag, 1.0, 2e-5) << "row " << i << " of n " << n << " H " << H;
          }
      }
    }
}

TEST(AttentionMassKernel, OnesGiveTheFarMass) {
  const AttnShape s = shape(200, 6, 2, 32, 8, 3);
  const Case c = make_case(s, 5000);
  for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead})
    for (int64_t C : {1, 4}) {
      const int64_t R = m == MassHeads::Mean ? 1 : 2;
      const VF X(s.n_q * C, 1.f);
      VF M(s.n_q * R * C), far(s.n_q * R);
      focus::cpu::attention_mass_forward(c.q.data(), c.k.data(), c.lse.data(), X.data(), C, s, m, M.data(),
                                         far.data());
      for (int64_t i = 0; i < s.n_q * R; ++i)
        for (int64_t g = 0; g < C; ++g) ASSERT_NEAR(M[i * C + g], far[i], 1e-6) << "row " << i << " column " << g;
    }
}

TEST(AttentionMassKernel, BitsDoNotDependOnThreadCount) {
  const AttnShape s = shape(333, 6, 2, 64, 8, 1);
  const Case c = make_case(s, 6000);
  const int64_t C = 16;
  const VF X = make_assignment(s.n_q, C, false, 6001), dM = make_normal(s.n_q * 2 * C, 6002);
  const int saved = focus::num_threads();
  for (MassHeads m : {MassHeads::Mean, MassHeads::PerKvHead}) {
    focus::set_threads(1);
    const Out a = run_kernels(c, c.lse, m, X, dM, C);
    focus::set_threads(2);
    const Out b = run_kernels(c, c.lse, m, X, dM, C);
    EXPECT_EQ(0, std::memcmp(a.M.data(), b.M.data(), a.M.size() * sizeof(float))) << "M";
    EXPECT_EQ(0, std::memcmp(a.far.data(), b.far.data(), a.far.size() * sizeof(float))) << "far";
    EXPECT_EQ(0, std::memcmp(a.dX.data(), b.dX.data(), a.dX.size() * sizeof(float))) << "dX";
  }
  focus::set_threads(saved);
}

TEST(AttentionMassKernel, BackwardAccumulates) {
  const AttnShape s = shape(130, 4, 2, 16, 8, 1);
  const Case c = make_case(s, 7000);
  const int64_t C = 4;
  const VF dM = make_normal(s.n_q * C, 7001);
  VF a(s.n_q * C, 0.f), b(s.n_q * C, 1.f);
  focus::cpu::attention_mass_backward(c.q.data(), c.k.data(), c.lse.data(), dM.data(), C, s, MassHeads::Mean,
                                      a.data());
  focus::cpu::attention_mass_backward(c.q.data(), c.k.data(), c.lse.data(), dM.data(), C, s, MassHeads::Mean,
                                      b.data());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(b[i], a[i] + 1.f) << i;
}

TEST(AttentionMassKernel, RejectsBadInputs) {
  AttnShape s = shape(4, 2, 1, 8, 1, 0);
  const VF q(4 * 2 * 8, 0.1f), k(4 * 8, 0.1f), X(4 * 2, 0.5f);
  VF lse(2 * 4, 0.f), M(4 * 2), dX(4 * 2);
  auto fwd = [&] {
    focus::cpu::attention_mass_forward(q.data(), k.data(), lse.data(), X.data(), 2, s, MassHeads::Mean, M.data());
  };
  auto bwd = [&] {
    focus::cpu::attention_mass_backward(q.data(), k.data(), lse.data(), X.data(), 2, s, MassHeads::Mean, dX.data());
  };
  EXPECT_NO_THROW(fwd());
  EXPECT_NO_THROW(bwd());
  s.sliding_window = 2;
  EXPECT_THROW(fwd(), focus::Error);
  s = shape(4, 2, 1, 8, 0, 0);  // local window 0: the diagonal would be far
  EXPECT_THROW(bwd(), focus::Error);
  s = shape(4, 3, 2, 8, 1, 0);  // 3 heads over 2 kv heads
  EXPECT_THROW(fwd(), focus::Error);
  s = shape(4, 2, 1, 8, 1, 0);
  lse[5] = -INFINITY;  // a row with no mass
  EXPECT_THROW(fwd(), focus::Error);
  EXPECT_THROW(bwd(), focus::Error);
  lse[5] = 0.f;
  EXPECT_THROW(focus::cpu::attention_mass_forward(q.data(), k.data(), lse.data(), nullptr, 2, s, MassHeads::Mean,
                                                  M.data()),
               focus::Error);  // M without X
  std::vector<uint64_t> bits(2 * 4 * 1, 0);
  focus::cpu::MassExclusion ex{bits.data(), nullptr, 1};
  EXPECT_NO_THROW(focus::cpu::attention_mass_forward(q.data(), k.data(), lse.data(), X.data(), 2, s, MassHeads::Mean,
                                                     M.data(), nullptr, &ex));
  EXPECT_THROW(focus::cpu::attention_mass_backward(q.data(), k.data(), lse.data(), X.data(), 2, s, MassHeads::Mean,
                                                   dX.data(), &ex),
               focus::Error);  // no transposed bits
  ex.words = 2;  // 4 tokens fit in one word
  EXPECT_THROW(focus::cpu::attention_mass_forward(q.data(), k.data(), lse.data(), X.data(), 2, s, MassHeads::Mean,
                                                  M.data(), nullptr, &ex),
               focus::Error);
}
