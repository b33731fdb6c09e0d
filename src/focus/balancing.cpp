#include "focus/balancing.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace focus {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

void check_nk(const char* who, int64_t n, int64_t g) {
  FOCUS_CHECK(n >= 0, who, ": negative token count ", n);
  FOCUS_CHECK(g >= 1, who, ": number of groups must be >= 1, got ", g);
}

// log softmax of one row of G logits (+ bias), into out.
void log_softmax_row(const float* s, const float* bias, int64_t g, float* out) {
  float mx = kNegInf;
  for (int64_t c = 0; c < g; ++c) mx = std::max(mx, out[c] = s[c] + (bias ? bias[c] : 0.f));
  double sum = 0.0;
  for (int64_t c = 0; c < g; ++c) sum += std::exp(out[c] - mx);
  const float lse = mx + (float)std::log(sum);
  for (int64_t c = 0; c < g; ++c) out[c] -= lse;
}

}  // namespace

void sinkhorn_forward(const float* logits, int64_t n, int64_t g, float scale, int iters, float* q) {
  check_nk("sinkhorn_forward", n, g);
  FOCUS_CHECK(iters >= 0, "sinkhorn_forward: iters must be >= 0, got ", iters);
  FOCUS_CHECK(std::isfinite(scale), "sinkhorn_forward: scale must be finite");
  if (n == 0) return;
  // log K = scale * logits; q = exp(log K + u_i + v_g). All in the log domain.
  std::vector<float> lk(n * g), u(n, 0.f), v(g, 0.f), cmax(g);
  for (int64_t i = 0; i < n * g; ++i) {
    lk[i] = scale * logits[i];
    FOCUS_CHECK(std::isfinite(lk[i]), "sinkhorn_forward: non-finite logit at token ", i / g, " group ", i % g);
  }
  const float log_col = std::log((float)n / (float)g);  // target column mass N / G
  std::vector<double> csum(g);
  auto fit_rows = [&] {  // u_i = -LSE_g(lk_ig + v_g): rows sum to 1
    for (int64_t i = 0; i < n; ++i) {
      const float* r = lk.data() + i * g;
      float mx = kNegInf;
      for (int64_t c = 0; c < g; ++c) mx = std::max(mx, r[c] + v[c]);
      double sum = 0.0;
      for (int64_t c = 0; c < g; ++c) sum += std::exp(r[c] + v[c] - mx);
      u[i] = -(mx + (float)std::log(sum));
    }
  };
  fit_rows();  // start from row-normalised scores
  for (int it = 0; it < iters; ++it) {
    // v_g = log(N / G) - LSE_i(lk_ig + u_i): columns sum to N / G.
    std::fill(cmax.begin(), cmax.end(), kNegInf);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < g; ++c) cmax[c] = std::max(cmax[c], lk[i * g + c] + u[i]);
    std::fill(csum.begin(), csum.end(), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t c = 0; c < g; ++c) csum[c] += std::exp(lk[i * g + c] + u[i] - cmax[c]);
    for (int64_t c = 0; c < g; ++c) v[c] = log_col - (cmax[c] + (float)std::log(csum[c]));
    fit_rows();
  }
  // The last row fit, written as a softmax of lk_i + v so that rows sum to 1 to fp32 rounding
  // even when lk and v are large and cancel.
  for (int64_t i = 0; i < n; ++i) {
    const float* r = lk.data() + i * g;
    float* out = q + i * g;
    float mx = kNegInf;
    for (int64_t c = 0; c < g; ++c) mx = std::max(mx, r[c] + v[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < g; ++c) sum += out[c] = std::exp(r[c] + v[c] - mx);
    const float inv = (float)(1.0 / sum);
    for (int64_t c = 0; c < g; ++c) out[c] *= inv;
  }
}

float swav_loss_forward(const float* s, const float* bias, const float* q, int64_t n, int64_t g) {
  check_nk("swav_loss_forward", n, g);
  if (n == 0) return 0.f;
  std::vector<float> lp(g);
  double loss = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    log_softmax_row(s + i * g, bias, g, lp.data());
    for (int64_t c = 0; c < g; ++c) loss -= (double)q[i * g + c] * lp[c];
  }
  return (float)(loss / n);
}

void swav_loss_backward(const float* s, const float* bias, const float* q, int64_t n, int64_t g, float dloss,
                        float* ds) {
  check_nk("swav_loss_backward", n, g);
  // dL/ds_ig = (p_ig * sum_h q_ih - q_ig) / N.
  std::vector<float> lp(g);
  const float k = dloss / (float)std::max<int64_t>(n, 1);
  for (int64_t i = 0; i < n; ++i) {
    log_softmax_row(s + i * g, bias, g, lp.data());
    float qsum = 0.f;
    for (int64_t c = 0; c < g; ++c) qsum += q[i * g + c];
    for (int64_t c = 0; c < g; ++c) ds[i * g + c] += k * (std::exp(lp[c]) * qsum - q[i * g + c]);
  }
}

BiasBalancer::BiasBalancer(int64_t g, float lr_, float decay_) : num_groups(g), lr(lr_), decay(decay_) {
  FOCUS_CHECK(g >= 1, "BiasBalancer: number of groups must be >= 1, got ", g);
  FOCUS_CHECK(decay_ >= 0.f && decay_ < 1.f, "BiasBalancer: decay must be in [0, 1), got ", decay_);
}

namespace {
void blend_load(BiasBalancer& b, const std::vector<double>& share) {
  if (b.load.empty()) {
    b.load = share;  // first observation
    return;
  }
  for (int64_t c = 0; c < b.num_groups; ++c) b.load[c] = b.decay * b.load[c] + (1.0 - b.decay) * share[c];
}
}  // namespace

void BiasBalancer::observe(const int32_t* groups, int64_t n, int64_t k) {
  const GroupLoadStats st = group_load_stats(groups, n, k, num_groups);
  if (n == 0) return;
  std::vector<double> share(num_groups);
  for (int64_t c = 0; c < num_groups; ++c) share[c] = (double)st.histogram[c] / (double)(n * k);
  blend_load(*this, share);
}

void BiasBalancer::observe_soft(const float* p, int64_t n) {
  FOCUS_CHECK(num_groups >= 1, "BiasBalancer: not initialised");
  if (n == 0) return;
  std::vector<double> share(num_groups, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < num_groups; ++c) share[c] += p[i * num_groups + c];
  double tot = 0.0;
  for (double x : share) tot += x;
  FOCUS_CHECK(tot > 0.0, "BiasBalancer::observe_soft: assignment has zero mass");
  for (double& x : share) x /= tot;
  blend_load(*this, share);
}

void BiasBalancer::update(float* bias) const {
  FOCUS_CHECK(num_groups >= 1, "BiasBalancer: not initialised");
  if (load.empty()) return;  // nothing observed yet
  const double mean = 1.0 / num_groups;
  double bmean = 0.0;
  for (int64_t c = 0; c < num_groups; ++c) {
    const double d = load[c] - mean;
    const double step = d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0;
    bias[c] -= (float)(lr * step);
    bmean += bias[c];
  }
  bmean /= num_groups;
  for (int64_t c = 0; c < num_groups; ++c) bias[c] -= (float)bmean;
}

GroupLoadStats group_load_stats(const int32_t* groups, int64_t n, int64_t k, int64_t g) {
  check_nk("group_load_stats", n, g);
  FOCUS_CHECK(k >= 1, "group_load_stats: k must be >= 1, got ", k);
  GroupLoadStats st;
  st.histogram.assign(g, 0);
  for (int64_t i = 0; i < n * k; ++i) {
    FOCUS_CHECK(groups[i] >= 0 && groups[i] < g, "group_load_stats: token ", i / k, " has group ", groups[i],
                " outside [0, ", g, ")");
    ++st.histogram[groups[i]];
  }
  st.max = *std::max_element(st.histogram.begin(), st.histogram.end());
  st.min = *std::min_element(st.histogram.begin(), st.histogram.end());
  st.mean = (double)(n * k) / (double)g;
  st.max_over_mean = st.mean > 0 ? st.max / st.mean : 0.0;
  return st;
}

}  // namespace focus
