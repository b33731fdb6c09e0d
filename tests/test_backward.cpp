// Backward passes: each op's input gradient against central differences of a float64 reference
// forward, and the router gradient through whole random models (Llama GQA, Gemma 3, GPT-2)
// against central differences of the float32 training loss. Also the log-softmax that scoring
// uses, against float64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "eval/perplexity.h"
#include "kernels/cpu/ops.h"
#include "train/backward.h"
#include "test_models.h"

using namespace focus;
using focus::test::random_model;
using focus::test::Win;
using focus::test::window_of;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// Checks dx (from the float backward) against d/dx_i sum(dy * f(x)) by central differences of
// the float64 forward f.
void check_fd(const std::vector<float>& x, const std::vector<float>& dy, const std::vector<float>& dx,
              const std::function<std::vector<double>(const std::vector<double>&)>& f, double tol) {
  std::vector<double> xd(x.begin(), x.end());
  const double h = 1e-5;
  double worst = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    auto xp = xd, xm = xd;
    xp[i] += h;
    xm[i] -= h;
    const auto yp = f(xp), ym = f(xm);
    double lp = 0, lm = 0;
    for (size_t j = 0; j < yp.size(); ++j) {
      lp += dy[j] * yp[j];
      lm += dy[j] * ym[j];
    }
    const double fd = (lp - lm) / (2 * h);
    const double err = std::abs(fd - dx[i]) / std::max(1.0, std::abs(fd));
    worst = std::max(worst, err);
  }
  EXPECT_LT(worst, tol);
}

std::vector<double> rms_ref(const std::vector<double>& x, const std::vector<float>& w, int64_t rows, int64_t dim,
                            double eps) {
  std::vector<double> y(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < dim; ++i) ss += x[r * dim + i] * x[r * dim + i];
    const double inv = 1 / std::sqrt(ss / dim + eps);
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = x[r * dim + i] * inv * w[i];
  }
  return y;
}

double gelu_ref(double v) { return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v))); }

}  // namespace

// log_prob (vector exponentials in float32, summed in float64) against a float64 log-softmax, on
// row lengths around the vector width and up to Gemma 3's vocabulary, logits spread from 1 to 40
// nats; a NaN anywhere in the row gives a NaN.
TEST(Ops, LogProbMatchesFloat64) {
  for (int64_t n : {1, 7, 15, 16, 17, 33, 1000, 49152, 262144})
    for (float scale : {1.f, 8.f, 40.f}) {
      const auto x = randn((size_t)n, (uint32_t)(n * 7 + (int)scale), scale);
      double mx = x[0];
      for (float v : x) mx = std::max(mx, (double)v);
      double s = 0;
      for (float v : x) s += std::exp((double)v - mx);
      for (int64_t t : {int64_t{0}, n / 2, n - 1}) {
        const double ref = (double)x[(size_t)t] - mx - std::log(s);
        EXPECT_NEAR(cpu::log_prob(x.data(), n, t), ref, 1e-6 * (1 + std::fabs(ref))) << "n " << n << " scale " << scale;
      }
    }
  auto x = randn(1000, 5);
  x[617] = std::nanf("");
  EXPECT_TRUE(std::isnan(cpu::log_prob(x.data(), 1000, 3)));
}

TEST(OpsBackward, RmsNorm) {
  const int64_t rows = 5, dim = 12;
  const auto x = randn(rows * dim, 1), w = randn(dim, 2), dy = randn(rows * dim, 3);
  std::vector<float> dx(rows * dim, 0.5f), dx_acc(rows * dim, 0.5f);
  cpu::rmsnorm_backward(x.data(), w.data(), dy.data(), dx.data(), rows, dim, 1e-5f, false);
  check_fd(x, dy, dx, [&](const std::vector<double>& v) { return rms_ref(v, w, rows, dim, 1e-5); }, 1e-5);
  cpu::rmsnorm_backward(x.data(), w.data(), dy.data(), dx_acc.data(), rows, dim, 1e-5f, true);
  for (size_t i = 0; i < dx.size(); ++i) EXPECT_FLOAT_EQ(dx_acc[i], dx[i] + 0.5f);
}

TEST(OpsBackward, LayerNorm) {
  const int64_t rows = 4, dim = 10;
  const auto x = randn(rows * dim, 4, 2.f), w = randn(dim, 5), dy = randn(rows * dim, 6);
  std::vector<float> dx(rows * dim);
  cpu::layernorm_backward(x.data(), w.data(), dy.data(), dx.data(), rows, dim, 1e-5f, false);
  check_fd(x, dy, dx,
           [&](const std::vector<double>& v) {
             std::vector<double> y(v.size());
             for (int64_t r = 0; r < rows; ++r) {
               double mu = 0, var = 0;
               for (int64_t i = 0; i < dim; ++i) mu += v[r * dim + i] / dim;
               for (int64_t i = 0; i < dim; ++i) var += (v[r * dim + i] - mu) * (v[r * dim + i] - mu) / dim;
               for (int64_t i = 0; i < dim; ++i)
                 y[r * dim + i] = (v[r * dim + i] - mu) / std::sqrt(var + 1e-5) * w[i] + 0.3;
             }
             return y;
           },
           1e-5);
}

TEST(OpsBackward, RopeBothLayouts) {
  const int64_t T = 6, H = 2, hd = 8, rot = 6, pos0 = 3;
  for (auto style : {cpu::RopeStyle::Interleaved, cpu::RopeStyle::SplitHalf}) {
    const auto x = randn(T * H * hd, 7), dy = randn(T * H * hd, 8);
    std::vector<float> dx = dy;
    cpu::rope_backward(dx.data(), T, H, hd, rot, pos0, 10000.f, style);
    // Rotation is linear: dL/dx = R^T dy, i.e. <dx, x> = <dy, R x> for every x.
    std::vector<float> rx = x;
    cpu::rope(rx.data(), T, H, hd, rot, pos0, 10000.f, style);
    double a = 0, b = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      a += (double)dx[i] * x[i];
      b += (double)dy[i] * rx[i];
    }
    EXPECT_NEAR(a, b, 1e-4 * std::max(1.0, std::abs(b)));
    // And undoes the rotation: rope_backward(rope(x)) == x.
    cpu::rope_backward(rx.data(), T, H, hd, rot, pos0, 10000.f, style);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(rx[i], x[i], 1e-5);
  }
}

TEST(OpsBackward, GatedActivationsAndGelu) {
  const int64_t n = 40;
  const auto g = randn(n, 9, 2.f), u = randn(n, 10), dy = randn(n, 11);
  std::vector<float> dg(n), du(n);
  // SwiGLU, gradient wrt gate then wrt up.
  cpu::silu_mul_backward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  check_fd(g, dy, dg, [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = silu(v[i]) * u[i];
    return y;
  }, 1e-5);
  check_fd(u, dy, du, [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = silu(g[i]) * v[i];
    return y;
  }, 1e-5);
  // GeGLU.
  cpu::gelu_tanh_mul_backward(g.data(), u.data(), dy.data(), dg.data(), du.data(), n);
  check_fd(g, dy, dg, [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_ref(v[i]) * u[i];
    return y;
  }, 1e-5);
  check_fd(u, dy, du, [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_ref(g[i]) * v[i];
    return y;
  }, 1e-5);
  // GELU.
  std::vector<float> dx(n);
  cpu::gelu_tanh_backward(g.data(), dy.data(), dx.data(), n);
  check_fd(g, dy, dx, [&](const std::vector<double>& v) {
    std::vector<double> y(n);
    for (int64_t i = 0; i < n; ++i) y[i] = gelu_ref(v[i]);
    return y;
  }, 1e-5);
}

TEST(OpsBackward, LinearInput) {
  const int64_t M = 3, K = 7, N = 5;
  const auto x = randn(M * K, 12), W = randn(N * K, 13), dy = randn(M * N, 14);
  std::vector<float> dx(M * K);
  cpu::linear_backward_input(dy.data(), W.data(), dx.data(), M, K, N, false);
  check_fd(x, dy, dx, [&](const std::vector<double>& v) {
    std::vector<double> y(M * N, 0.0);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < N; ++c)
        for (int64_t k = 0; k < K; ++k) y[r * N + c] += v[r * K + k] * W[c * K + k];
    return y;
  }, 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Whole random models.

namespace {

FocusRouters routers_for(const Model& m) {
  FocusSettings s;
  s.mode = FocusMode::Soft;
  s.local_window = 4;
  s.sinks = 1;
  s.groups = 4;
  s.dg = 8;
  s.tau = 0.5f;
  return focus_init(m.cfg, s, 7);
}


class ModelGrad : public ::testing::TestWithParam<Arch> {};

}  // namespace

// The router gradient of the whole model matches central differences of the float32 loss, along
// the gradient direction and for the largest single coordinates of every router.
TEST_P(ModelGrad, RouterGradientMatchesFiniteDifferences) {
  auto m = random_model(GetParam(), 100);
  FocusRouters f = routers_for(*m);
  ASSERT_FALSE(f.routers.empty());
  const int64_t T = 29;
  const Win w = window_of(T, m->cfg.vocab, 5);
  const TrainWindow tw{w.ids.data(), T, w.targets.data()};
  const float scale = 1.f / (T - 2);
  std::vector<std::vector<float>> g(f.routers.size());
  for (size_t r = 0; r < g.size(); ++r) g[r].assign(f.routers[r].params.size(), 0.f);
  const LossGrad lg = focus_router_loss_and_grad(*m, f, tw, scale, &g);
  EXPECT_EQ(lg.scored, T - 2);

  auto loss_at = [&](const std::function<void(FocusRouters&)>& edit) {
    FocusRouters f2 = f;
    edit(f2);
    return focus_router_loss(*m, f2, tw) * scale;
  };
  focus::test::expect_directional_derivative(g, [&](double s) {
    return loss_at([&](FocusRouters& f2) {
      for (size_t r = 0; r < g.size(); ++r)
        for (size_t i = 0; i < g[r].size(); ++i) f2.routers[r].params[i] += (float)(s * g[r][i]);
    });
  });
  const double h = 1e-2;
  // The three largest coordinates of each router.
  for (size_t r = 0; r < g.size(); ++r) {
    std::vector<size_t> idx(g[r].size());
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
    std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(),
                      [&](size_t a, size_t b) { return std::abs(g[r][a]) > std::abs(g[r][b]); });
    for (int k = 0; k < 3; ++k) {
      const size_t i = idx[k];
      auto at = [&](double t) { return loss_at([&](FocusRouters& f2) { f2.routers[r].params[i] += (float)t; }); };
      const double fdi = (at(h) - at(-h)) / (2 * h);
      EXPECT_NEAR(fdi, g[r][i], 5e-3 * std::abs(g[r][i]) + 2e-4) << "router " << r << " param " << i;
    }
  }
}

// Keeping activations and recomputing them give the same bits.
TEST_P(ModelGrad, RecomputeEqualsKeep) {
  auto m = random_model(GetParam(), 200);
  FocusRouters f = routers_for(*m);
  const Win w = window_of(21, m->cfg.vocab, 6);
  const TrainWindow tw{w.ids.data(), 21, w.targets.data()};
  std::vector<std::vector<float>> a(f.routers.size()), b(f.routers.size());
  for (size_t r = 0; r < a.size(); ++r) a[r] = b[r] = std::vector<float>(f.routers[r].params.size(), 0.f);
  BackwardOptions keep, rec;
  keep.force_recompute = 0;
  rec.force_recompute = 1;
  const LossGrad la = focus_router_loss_and_grad(*m, f, tw, 0.1f, &a, nullptr, keep);
  const LossGrad lb = focus_router_loss_and_grad(*m, f, tw, 0.1f, &b, nullptr, rec);
  EXPECT_EQ(la.loss_sum, lb.loss_sum);
  for (size_t r = 0; r < a.size(); ++r) EXPECT_EQ(a[r], b[r]);
}

// The training forward (soft kernel everywhere) gives the loss of the inference forward pass.
TEST_P(ModelGrad, TrainingLossEqualsEvalLoss) {
  auto m = random_model(GetParam(), 300);
  FocusRouters f = routers_for(*m);
  const Win w = window_of(40, m->cfg.vocab, 8);
  const TrainWindow tw{w.ids.data(), 40, w.targets.data()};
  int64_t n1 = 0, n2 = 0;
  const double train = focus_router_loss(*m, f, tw, &n1);
  const AttentionPlan plan = focus_plan(m->cfg, f);
  const double eval = window_nll(*m, w.ids, w.targets, &plan, nullptr, &n2);
  EXPECT_EQ(n1, n2);
  EXPECT_NEAR(train, eval, 1e-5 * std::abs(eval));
  // And without routers, the plain model's loss.
  FocusRouters none = f;
  none.router_of_layer.assign(m->cfg.layers, -1);
  const double plain = window_nll(*m, w.ids, w.targets, nullptr, nullptr, &n2);
  EXPECT_NEAR(focus_router_loss(*m, none, tw), plain, 1e-5 * std::abs(plain));
}

INSTANTIATE_TEST_SUITE_P(Arches, ModelGrad, ::testing::Values(Arch::Llama, Arch::Gemma3, Arch::GPT2),
                         [](const auto& info) { return to_string(info.param); });

// An auxiliary loss through the hook reaches the router parameters.
TEST(ModelGradHook, AuxiliaryScoreGradient) {
  auto m = random_model(Arch::Llama, 400);
  FocusRouters f = routers_for(*m);
  const Win w = window_of(16, m->cfg.vocab, 9);
  const TrainWindow tw{w.ids.data(), 16, w.targets.data()};
  std::vector<std::vector<float>> a(f.routers.size()), b(f.routers.size());
  for (size_t r = 0; r < a.size(); ++r) a[r] = b[r] = std::vector<float>(f.routers[r].params.size(), 0.f);
  focus_router_loss_and_grad(*m, f, tw, 0.f, &a);  // zero loss scale: no gradient from the LM loss
  int calls = 0;
  focus_router_loss_and_grad(*m, f, tw, 0.f, &b, [&](int64_t, const RouterCache& rc, float* ds) {
    ++calls;
    for (int64_t i = 0; i < rc.n * f.settings.groups; ++i) ds[i] = 1e-2f * (float)(i % 3);
  });
  EXPECT_EQ(calls, (int)f.routers.size());
  double na = 0, nb = 0;
  for (size_t r = 0; r < a.size(); ++r)
    for (size_t i = 0; i < a[r].size(); ++i) {
      na += std::abs(a[r][i]);
      nb += std::abs(b[r][i]);
    }
  EXPECT_EQ(na, 0.0);
  EXPECT_GT(nb, 0.0);
}
