#include "train/adamw.h"

#include <cmath>

#include "core/error.h"

namespace focus {

float lr_schedule(float lr, int64_t step, int64_t total, int64_t warmup, float min_ratio) {
  if (warmup > 0 && step < warmup) return lr * (float)(step + 1) / (float)warmup;
  const int64_t span = std::max<int64_t>(1, total - warmup);
  const double prog = std::min(1.0, (double)(step - warmup) / (double)span);
  return (float)(lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + std::cos(M_PI * prog))));
}

double adamw_step(const AdamWConfig& c, float lr, std::vector<std::vector<float>*>& params,
                  const std::vector<std::vector<float>>& grads, AdamWState& st, const std::vector<bool>* decay) {
  FOCUS_CHECK(params.size() == grads.size(), "adamw: ", params.size(), " parameter blocks but ", grads.size(),
              " gradient blocks");
  if (st.m.size() != params.size()) {
    st.m.assign(params.size(), {});
    st.v.assign(params.size(), {});
    for (size_t b = 0; b < params.size(); ++b) {
      st.m[b].assign(params[b]->size(), 0.f);
      st.v[b].assign(params[b]->size(), 0.f);
    }
  }
  FOCUS_CHECK(!decay || decay->empty() || decay->size() == params.size(), "adamw: ", decay ? decay->size() : 0,
              " weight-decay flags for ", params.size(), " parameter blocks");
  double sq = 0;
  for (const auto& g : grads)
    for (float x : g) sq += (double)x * x;
  const double norm = std::sqrt(sq);
  FOCUS_CHECK(std::isfinite(norm), "adamw: the gradient holds NaN or Inf");
  const float clip = (c.grad_clip > 0 && norm > c.grad_clip) ? (float)(c.grad_clip / norm) : 1.f;
  st.t++;
  const double bc1 = 1.0 - std::pow((double)c.beta1, (double)st.t);
  const double bc2 = 1.0 - std::pow((double)c.beta2, (double)st.t);
  for (size_t b = 0; b < params.size(); ++b) {
    std::vector<float>& p = *params[b];
    const std::vector<float>& g = grads[b];
    FOCUS_CHECK(p.size() == g.size(), "adamw: block ", b, " has ", p.size(), " parameters but ", g.size(),
                " gradients");
    float* m = st.m[b].data();
    float* v = st.v[b].data();
    const float wd = (decay && !decay->empty() && !(*decay)[b]) ? 0.f : c.weight_decay;
    for (size_t i = 0; i < p.size(); ++i) {
      const float gi = g[i] * clip;
      m[i] = c.beta1 * m[i] + (1 - c.beta1) * gi;
      v[i] = c.beta2 * v[i] + (1 - c.beta2) * gi * gi;
      const double mh = m[i] / bc1, vh = v[i] / bc2;
      p[i] -= (float)(lr * (mh / (std::sqrt(vh) + c.eps) + wd * p[i]));
    }
  }
  return norm;
}

}  // namespace focus
