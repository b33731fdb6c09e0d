#include "focus/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "core/error.h"
#include "core/rng.h"
#include "core/threads.h"
#include "kernels/cpu/simd.h"

namespace focus {
namespace {

constexpr float kNormFloor = 1e-12f;  // |r| and |c| below this are treated as this (avoids 0/0)

using namespace cpu::simd;

// sum_d a[d] * b[d], vectorised; the summation order is fixed. 32 floats per step, in as many
// vector accumulators as that takes (at least 2), so the adds of one step are independent.
float dot(const float* a, const float* b, int64_t n) {
  constexpr int kAcc = 32 / kV > 2 ? 32 / kV : 2, kStep = kAcc * kV;
  vf acc[kAcc] = {};
  int64_t d = 0;
  for (; d + kStep <= n; d += kStep)
    for (int i = 0; i < kAcc; ++i) acc[i] = vfma(load(a + d + i * kV), load(b + d + i * kV), acc[i]);
  for (; d + kV <= n; d += kV) acc[0] = vfma(load(a + d), load(b + d), acc[0]);
  for (int w = kAcc / 2; w >= 1; w /= 2)  // pairwise: acc[i] += acc[i + w]
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  float s = 0.f;
  for (int i = 0; i < kV; ++i) s += acc[0][i];
  for (; d < n; ++d) s += a[d] * b[d];
  return s;
}

// The projection r[i, a] = sum_d W[a, d] x[i, d] of rows i < n (W [dg, D], r [n, dg]). Each r[i, a]
// is one float32 FMA chain over d in order, so a row's numbers do not depend on the rows done
// with it, nor on the projections computed beside it (prefill and decoding route a token alike).
// Vectorised over a (W transposed into wt [D, nv * kV], zero-padded), kNr rows and kNc vectors of
// columns at a time, the accumulators in registers, so each W vector loaded serves kNr rows.
template <int kNr, int kNc>
void project_cols(const float* wt, int64_t nv, int64_t c0, const float* x, int64_t D, int64_t dg, float* r) {
  vf acc[kNr][kNc] = {};
  const float* w = wt + c0 * kV;
  for (int64_t d = 0; d < D; ++d, w += nv * kV) {
    vf wv[kNc];
    for (int c = 0; c < kNc; ++c) wv[c] = load(w + c * kV);
    for (int j = 0; j < kNr; ++j) {
      const vf xb = bcast(x[j * D + d]);
      for (int c = 0; c < kNc; ++c) acc[j][c] = vfma(wv[c], xb, acc[j][c]);
    }
  }
  for (int j = 0; j < kNr; ++j)
    for (int c = 0; c < kNc; ++c)
      for (int l = 0; l < kV && (c0 + c) * kV + l < dg; ++l) r[j * dg + (c0 + c) * kV + l] = acc[j][c][l];
}

// All nv column vectors of kNr rows. One row (decoding) takes up to 12 vectors per pass: one
// router's chains are too few to hide the FMA latency, the projections of a layer's routers side
// by side (RouterProjections) are not.
// Column vectors [c0, c1) of kNr rows.
template <int kNr>
void project_rows(const float* wt, int64_t nv, int64_t c0, int64_t c1, const float* x, int64_t D, int64_t dg,
                  float* r) {
  constexpr int kMax = kNr == 1 ? 12 : 2;
  for (; c0 + kMax <= c1; c0 += kMax) project_cols<kNr, kMax>(wt, nv, c0, x, D, dg, r);
  if constexpr (kMax > 8)
    if (c0 + 8 <= c1) project_cols<kNr, 8>(wt, nv, c0, x, D, dg, r), c0 += 8;
  if constexpr (kMax > 4)
    if (c0 + 4 <= c1) project_cols<kNr, 4>(wt, nv, c0, x, D, dg, r), c0 += 4;
  if constexpr (kMax > 2)
    if (c0 + 2 <= c1) project_cols<kNr, 2>(wt, nv, c0, x, D, dg, r), c0 += 2;
  if (c0 < c1) project_cols<kNr, 1>(wt, nv, c0, x, D, dg, r);
}

// Rows x [n, D] through wt [D, nv * kV] into r [n, dg] (dg <= nv * kV), kNr rows at a time. A
// few rows against many columns (a decoding step through every router of a layer: the matrices,
// not the arithmetic, are the cost) split the columns over the threads instead.
void project_all(const float* wt, int64_t nv, const float* x, int64_t n, int64_t D, int64_t dg, float* r, bool par) {
  constexpr int64_t kNr = 4;
  if (n < kNr && par && nv >= 2) {
#pragma omp parallel
    {
      const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t c0 = nv * t / nt, c1 = nv * (t + 1) / nt;
      for (int64_t i = 0; i < n; ++i) project_rows<1>(wt, nv, c0, c1, x + i * D, D, dg, r + i * dg);
    }
    return;
  }
  const int64_t nb = n / kNr;
#pragma omp parallel for schedule(static) if (par)
  for (int64_t b = 0; b < nb; ++b) project_rows<kNr>(wt, nv, 0, nv, x + b * kNr * D, D, dg, r + b * kNr * dg);
  for (int64_t i = nb * kNr; i < n; ++i) project_rows<1>(wt, nv, 0, nv, x + i * D, D, dg, r + i * dg);
}

// a * b + c rounded as vfma rounds each lane (one rounding where vfma uses FMA).
inline float lane_fma(float a, float b, float c) {
#if defined(__x86_64__) && defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// W [dg, D] transposed into the columns [0, dg) of wt, whose rows are `stride` floats apart.
void transpose_into(const float* W, int64_t D, int64_t dg, float* wt, int64_t stride) {
  for (int64_t a = 0; a < dg; ++a)
    for (int64_t d = 0; d < D; ++d) wt[d * stride + a] = W[a * D + d];
}

// Fewer than 16 rows (decoding, small chunks) run the same chains as scalars from W as it lies;
// more transpose W first.
void project(const float* W, const float* x, int64_t n, int64_t D, int64_t dg, float* r, bool par) {
  if (n < 16) {
    constexpr int64_t kA = 16;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t a0 = 0; a0 < dg; a0 += kA) {
        const int64_t na = std::min(kA, dg - a0);
        float acc[kA] = {};
        for (int64_t d = 0; d < D; ++d)
          for (int64_t a = 0; a < na; ++a) acc[a] = lane_fma(W[(a0 + a) * D + d], x[i * D + d], acc[a]);
        std::copy(acc, acc + na, r + i * dg + a0);
      }
    return;
  }
  const int64_t nv = (dg + kV - 1) / kV;
  std::vector<float> wt((size_t)(D * nv * kV), 0.f);
  transpose_into(W, D, dg, wt.data(), nv * kV);
  project_all(wt.data(), nv, x, n, D, dg, r, par);
}

void check_config(const RouterConfig& c) {
  FOCUS_CHECK(c.dim >= 1, "router: input width D must be >= 1, got ", c.dim);
  FOCUS_CHECK(c.d_g >= 1 && c.d_g <= c.dim, "router: d_g must be in [1, D=", c.dim, "], got ", c.d_g);
  FOCUS_CHECK(c.groups >= 1, "router: number of groups must be >= 1, got ", c.groups);
  FOCUS_CHECK(c.tau > 0.f && std::isfinite(c.tau), "router: tau must be positive and finite, got ", c.tau);
}

void check_params(const RouterParams& rp) {
  check_config(rp.cfg);
  FOCUS_CHECK((int64_t)rp.params.size() == rp.size(), "router: parameter vector has ", rp.params.size(),
              " floats, config needs ", rp.size());
  FOCUS_CHECK((int64_t)rp.bias.size() == rp.cfg.groups, "router: bias has ", rp.bias.size(), " entries, G = ",
              rp.cfg.groups);
}

}  // namespace

float RouterParams::tau() const { return cfg.learn_tau ? std::exp(params[log_tau_offset()]) : cfg.tau; }

RouterParams router_init(const RouterConfig& cfg, uint64_t seed) {
  check_config(cfg);
  RouterParams rp;
  rp.cfg = cfg;
  rp.params.assign(rp.size(), 0.f);
  rp.bias.assign(cfg.groups, 0.f);
  Rng rng{seed};
  const double wscale = 1.0 / std::sqrt((double)cfg.dim);
  for (int64_t i = 0; i < cfg.d_g * cfg.dim; ++i) rp.params[i] = (float)(rng.normal() * wscale);
  // W_k is drawn after the centroids (below), so a symmetric router's numbers do not change.
  float* c = rp.centroids();
  for (int64_t g = 0; g < cfg.groups; ++g) {
    double n2 = 0;
    std::vector<double> v(cfg.d_g);
    for (auto& e : v) {
      e = rng.normal();
      n2 += e * e;
    }
    const double inv = 1.0 / std::sqrt(std::max(n2, 1e-30));
    for (int64_t a = 0; a < cfg.d_g; ++a) c[g * cfg.d_g + a] = (float)(v[a] * inv);
  }
  if (cfg.learn_tau) rp.params[rp.log_tau_offset()] = std::log(cfg.tau);
  if (cfg.key_proj)
    for (int64_t i = 0; i < cfg.d_g * cfg.dim; ++i) rp.params[rp.w_k_offset() + i] = (float)(rng.normal() * wscale);
  return rp;
}

RouterProjections router_projections(const std::vector<std::pair<const RouterParams*, RouterSide>>& list,
                                     const std::vector<std::pair<const RouterParams*, RouterSide>>& far) {
  RouterProjections rp;
  FOCUS_CHECK(!list.empty(), "router_projections: no projections");
  rp.dim = list[0].first->cfg.dim;
  for (const auto& [r, side] : list) {
    check_params(*r);
    FOCUS_CHECK(r->cfg.dim == rp.dim, "router_projections: input widths ", rp.dim, " and ", r->cfg.dim, " differ");
    rp.offset.push_back(rp.stride);
    rp.width.push_back(r->cfg.d_g);
    rp.stride += (r->cfg.d_g + kV - 1) / kV * kV;  // each projection starts on a whole vector
  }
  for (const auto& [r, side] : far) {
    check_params(*r);
    FOCUS_CHECK(r->cfg.dim == rp.dim && r->cfg.far_bias, "router_projections: a far-pair term of another width or ",
                "of a router without them");
    rp.far.push_back(rp.stride + (int64_t)rp.far.size());
  }
  rp.stride += ((int64_t)far.size() + kV - 1) / kV * kV;
  const int64_t D = rp.dim;
  rp.wt.assign((size_t)(D * rp.stride), 0.f);
  for (size_t p = 0; p < list.size(); ++p) {
    const RouterParams& r = *list[p].first;
    transpose_into(r.params.data() + r.proj_offset(list[p].second), D, rp.width[p], rp.wt.data() + rp.offset[p],
                   rp.stride);
  }
  for (size_t p = 0; p < far.size(); ++p) {
    const RouterParams& r = *far[p].first;
    transpose_into(r.params.data() + r.far_offset(far[p].second), D, 1, rp.wt.data() + rp.far[p], rp.stride);
  }
  return rp;
}

std::vector<float> RouterProjections::rows(const float* x, int64_t n) const {
  std::vector<float> r;
  if (stride == 0) return r;
  r.resize(n * stride);
  project(x, n, r.data());
  return r;
}

void RouterProjections::project(const float* x, int64_t n, float* r) const {
  FOCUS_CHECK(stride > 0 && (int64_t)wt.size() == dim * stride, "RouterProjections: not made by router_projections");
  project_all(wt.data(), stride / kV, x, n, dim, stride, r, n * dim * stride > (1 << 15));
}

void router_forward(const RouterParams& rp, const float* x, int64_t n, RouterCache& cache, RouterSide side,
                    bool probs, const float* projected, int64_t projected_stride) {
  check_params(rp);
  FOCUS_CHECK(n >= 0, "router_forward: negative token count ", n);
  FOCUS_CHECK(n == 0 || x || projected, "router_forward: null input");
  FOCUS_CHECK(!projected || projected_stride >= rp.cfg.d_g, "router_forward: projected rows of ", projected_stride,
              " floats hold no d_g = ", rp.cfg.d_g, " projection");
  const int64_t D = rp.cfg.dim, dg = rp.cfg.d_g, G = rp.cfg.groups;
  const float inv_tau = 1.f / rp.tau();
  FOCUS_CHECK(std::isfinite(inv_tau), "router_forward: temperature overflowed (log_tau out of range)");
  const float* W = rp.params.data() + rp.proj_offset(side);  // [d_g, D]
  const float* C = rp.centroids();  // [G, d_g]
  const float* b = rp.bias.data();  // [G]

  cache.n = n;
  cache.r_hat.resize(n * dg);
  cache.r_norm.resize(n);
  cache.c_hat.resize(G * dg);
  cache.c_norm.resize(G);
  cache.s.resize(n * G);
  cache.p.resize(probs ? n * G : 0);
  for (int64_t g = 0; g < G; ++g) {
    const float nrm = std::max(std::sqrt(dot(C + g * dg, C + g * dg, dg)), kNormFloor);
    cache.c_norm[g] = nrm;
    for (int64_t a = 0; a < dg; ++a) cache.c_hat[g * dg + a] = C[g * dg + a] / nrm;
  }

  const bool par = n * D * dg > (1 << 18);  // threads only pay off on real sizes
  if (projected)
    for (int64_t i = 0; i < n; ++i) std::copy_n(projected + i * projected_stride, dg, cache.r_hat.data() + i * dg);
  else
    project(W, x, n, D, dg, cache.r_hat.data(), par);
  parallel_for(n, par, [&](int64_t i) {
    float* u = cache.r_hat.data() + i * dg;  // r_i, then normalised in place
    float n2 = 0.f;
    for (int64_t a = 0; a < dg; ++a) n2 += u[a] * u[a];
    const float nrm = std::max(std::sqrt(n2), kNormFloor);
    cache.r_norm[i] = nrm;
    for (int64_t a = 0; a < dg; ++a) u[a] /= nrm;
    float* s = cache.s.data() + i * G;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < G; ++g) {
      float c = 0.f;
      for (int64_t a = 0; a < dg; ++a) c += u[a] * cache.c_hat[g * dg + a];
      s[g] = c * inv_tau;
      mx = std::max(mx, s[g] + b[g]);
    }
    if (!probs) return;
    float* p = cache.p.data() + i * G;
    float sum = 0.f;
    for (int64_t g = 0; g < G; ++g) sum += (p[g] = std::exp(s[g] + b[g] - mx));
    for (int64_t g = 0; g < G; ++g) p[g] /= sum;
  });
}

void router_backward(const RouterParams& rp, const float* x, const RouterCache& cache, const float* dp,
                     const float* ds_in, float* dparams, float* dx, RouterSide side) {
  check_params(rp);
  const int64_t n = cache.n, D = rp.cfg.dim, dg = rp.cfg.d_g, G = rp.cfg.groups;
  FOCUS_CHECK((int64_t)cache.s.size() == n * G && (int64_t)cache.r_hat.size() == n * dg,
              "router_backward: cache does not match the router config (run router_forward first)");
  FOCUS_CHECK(dparams, "router_backward: null parameter gradient");
  FOCUS_CHECK(n == 0 || x, "router_backward: null input");
  const float inv_tau = 1.f / rp.tau();
  const float* W = rp.params.data() + rp.proj_offset(side);
  float* dW = dparams + rp.proj_offset(side);
  float* dC = dparams + rp.centroids_offset();

  // dcos [N, G] = dL/ds / tau, with dL/ds = p * (dp - <p, dp>) + ds_in; dr [N, d_g].
  std::vector<float> dcos(n * G), dr(n * dg), dlt(n);  // dlt: per-row dL/dlog_tau, summed in order
  const bool par = n * D * dg > (1 << 18);
#pragma omp parallel for schedule(static) if (par)
  for (int64_t i = 0; i < n; ++i) {
    const float* p = cache.p.data() + i * G;
    const float* s = cache.s.data() + i * G;
    float* dc = dcos.data() + i * G;
    float pdp = 0.f, dlti = 0.f;
    if (dp)
      for (int64_t g = 0; g < G; ++g) pdp += p[g] * dp[i * G + g];
    for (int64_t g = 0; g < G; ++g) {
      float d = dp ? p[g] * (dp[i * G + g] - pdp) : 0.f;
      if (ds_in) d += ds_in[i * G + g];
      dlti -= d * s[g];  // s = cos * exp(-log_tau)
      dc[g] = d * inv_tau;
    }
    dlt[i] = dlti;
    // du = sum_g dcos_g c_hat_g; dr = (du - u <u, du>) / |r|.
    const float* u = cache.r_hat.data() + i * dg;
    float* dri = dr.data() + i * dg;
    for (int64_t a = 0; a < dg; ++a) dri[a] = 0.f;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t a = 0; a < dg; ++a) dri[a] += dc[g] * cache.c_hat[g * dg + a];
    float udu = 0.f;
    for (int64_t a = 0; a < dg; ++a) udu += u[a] * dri[a];
    const float inv_n = 1.f / cache.r_norm[i];
    for (int64_t a = 0; a < dg; ++a) dri[a] = (dri[a] - u[a] * udu) * inv_n;
    // dx_i += W^T dr_i.
    if (dx) {
      float* dxi = dx + i * D;
      for (int64_t a = 0; a < dg; ++a) {
        const float c = dri[a];
        const float* w = W + a * D;
        for (int64_t d = 0; d < D; ++d) dxi[d] += c * w[d];
      }
    }
  }
  // dW [d_g, D] += sum_i dr_i x_i^T: each thread owns a slice of columns, sums over i in order.
#pragma omp parallel for schedule(static) if (par)
  for (int64_t blk = 0; blk < (D + 63) / 64; ++blk) {
    const int64_t d0 = blk * 64, d1 = std::min<int64_t>(D, d0 + 64);
    for (int64_t i = 0; i < n; ++i) {
      const float* xi = x + i * D;
      for (int64_t a = 0; a < dg; ++a) {
        const float c = dr[i * dg + a];
        float* w = dW + a * D;
        for (int64_t d = d0; d < d1; ++d) w[d] += c * xi[d];
      }
    }
  }
  // dC: dc_hat_g = sum_i dcos_ig u_i; dc_g = (dc_hat - c_hat <c_hat, dc_hat>) / |c_g|.
  std::vector<float> dch(G * dg, 0.f);
  for (int64_t i = 0; i < n; ++i) {
    const float* u = cache.r_hat.data() + i * dg;
    for (int64_t g = 0; g < G; ++g) {
      const float c = dcos[i * G + g];
      for (int64_t a = 0; a < dg; ++a) dch[g * dg + a] += c * u[a];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* ch = cache.c_hat.data() + g * dg;
    float proj = 0.f;
    for (int64_t a = 0; a < dg; ++a) proj += ch[a] * dch[g * dg + a];
    for (int64_t a = 0; a < dg; ++a) dC[g * dg + a] += (dch[g * dg + a] - ch[a] * proj) / cache.c_norm[g];
  }
  if (rp.cfg.learn_tau) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) sum += dlt[i];
    dparams[rp.log_tau_offset()] += (float)sum;
  }
}

void router_far_bias(const RouterParams& rp, const float* x, int64_t n, RouterSide side, float* e) {
  check_params(rp);
  FOCUS_CHECK(rp.cfg.far_bias, "router_far_bias: the router has no far-pair terms");
  FOCUS_CHECK(n == 0 || (x && e), "router_far_bias: null buffer");
  const int64_t D = rp.cfg.dim;
  std::vector<float> fx(n);  // <f, x_i>
  project(rp.params.data() + rp.far_offset(side), x, n, D, 1, fx.data(), n * D > (1 << 18));
  router_far_bias_projected(rp, side, fx.data(), 1, n, e);
}

void router_far_bias_projected(const RouterParams& rp, RouterSide side, const float* projected, int64_t stride,
                               int64_t n, float* e) {
  check_params(rp);
  FOCUS_CHECK(rp.cfg.far_bias, "router_far_bias: the router has no far-pair terms");
  FOCUS_CHECK(n == 0 || (projected && e), "router_far_bias: null buffer");
  const int64_t D = rp.cfg.dim;
  const float b = rp.params[rp.far_offset(side) + D], inv = 1.f / std::sqrt((float)D);
  for (int64_t i = 0; i < n; ++i)
    e[i] = std::clamp(kFarBiasGain * (projected[i * stride] * inv + b), -kFarBiasLimit, kFarBiasLimit);
}

void router_far_bias_backward(const RouterParams& rp, const float* x, int64_t n, RouterSide side, const float* e,
                              const float* de, float* dparams, float* dx) {
  check_params(rp);
  FOCUS_CHECK(rp.cfg.far_bias, "router_far_bias_backward: the router has no far-pair terms");
  FOCUS_CHECK(n == 0 || (x && e && de), "router_far_bias_backward: null buffer");
  FOCUS_CHECK(dparams, "router_far_bias_backward: null parameter gradient");
  const int64_t D = rp.cfg.dim;
  const float* f = rp.params.data() + rp.far_offset(side);
  float* df = dparams + rp.far_offset(side);
  const float inv = 1.f / std::sqrt((float)D);
  double db = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::fabs(e[i]) >= kFarBiasLimit) continue;  // clamped
    const float g = de[i] * kFarBiasGain;
    db += g;
    const float* xi = x + i * D;
    for (int64_t d = 0; d < D; ++d) df[d] += g * inv * xi[d];
    if (dx)
      for (int64_t d = 0; d < D; ++d) dx[i * D + d] += g * inv * f[d];
  }
  df[D] += (float)db;
}

void router_topk(const float* logits, const float* bias, int64_t n, int64_t g, int k, int32_t* groups) {
  FOCUS_CHECK(k >= 1 && k <= g, "router_topk: k must be in [1, G=", g, "], got ", k);
  FOCUS_CHECK(n >= 0, "router_topk: negative token count ", n);
  FOCUS_CHECK(n == 0 || (logits && groups), "router_topk: null buffer");
  for (int64_t i = 0; i < n; ++i) {
    const float* s = logits + i * g;
    int32_t* out = groups + i * k;
    // Selection by repeated max: k is small (1 to a few).
    int cnt = 0;
    for (int t = 0; t < k; ++t) {
      int best = -1;
      float bv = 0.f;
      for (int64_t c = 0; c < g; ++c) {
        bool taken = false;
        for (int u = 0; u < cnt; ++u) taken |= out[u] == c;
        if (taken) continue;
        const float v = s[c] + (bias ? bias[c] : 0.f);
        if (best < 0 || v > bv) best = (int)c, bv = v;
      }
      out[cnt++] = best;
    }
    std::sort(out, out + k);
  }
}

void router_topp(const float* logits, const float* bias, int64_t n, int64_t g, float p, int kmax, int32_t* groups) {
  FOCUS_CHECK(kmax >= 1 && kmax <= g, "router_topp: kmax must be in [1, G=", g, "], got ", kmax);
  FOCUS_CHECK(p > 0.f && p <= 1.f, "router_topp: p must be in (0, 1], got ", p);
  FOCUS_CHECK(n >= 0, "router_topp: negative token count ", n);
  FOCUS_CHECK(n == 0 || (logits && groups), "router_topp: null buffer");
  std::vector<float> v(g);
  std::vector<int32_t> order(g);
  for (int64_t i = 0; i < n; ++i) {
    const float* s = logits + i * g;
    float mx = -INFINITY;
    for (int64_t c = 0; c < g; ++c) mx = std::max(mx, v[c] = s[c] + (bias ? bias[c] : 0.f));
    double z = 0;
    for (int64_t c = 0; c < g; ++c) z += std::exp((double)(v[c] - mx));
    for (int64_t c = 0; c < g; ++c) order[c] = (int32_t)c;
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
    int32_t* out = groups + i * kmax;
    int cnt = 0;
    double acc = 0;
    while (cnt < kmax) {
      const int32_t c = order[cnt];
      out[cnt++] = c;
      acc += std::exp((double)(v[c] - mx)) / z;
      if (acc >= (double)p) break;
    }
    std::sort(out, out + cnt);
    std::fill(out + cnt, out + kmax, -1);
  }
}

}  // namespace focus
