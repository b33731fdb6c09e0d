// The Focus router (spec section 2): one per layer, shared by all heads of the layer.
//   r_i  = W_r x_i                                   x [N, D] -> r [N, d_g]
//   s_ig = <r_i / |r_i|, c_g / |c_g|> / tau          cosine scores [N, G]
//   p_i  = softmax_g(s_i + b)                        soft assignment [N, G] (b: balancing bias)
// Hard mode keeps the top-k groups of s_i + b per token (router_topk).
// Asymmetric routers (key_proj) score a token as a key with a second projection W_k and the same
// centroids: a query reads its top-k groups, a key belongs to one (focus/focus_attention.h).
// Backward passes accumulate (+=) into their gradient buffers; the caller zeroes them.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace focus {

struct RouterConfig {
  int64_t dim = 0;         // D: width of the router input (the attention block's normed input)
  int64_t d_g = 16;        // routing dimension, 1 <= d_g <= D
  int64_t groups = 8;      // G
  float tau = 0.1f;        // temperature (the initial value when learned)
  bool learn_tau = false;  // train log_tau as a parameter
  bool key_proj = false;   // a second projection W_k for keys (asymmetric routing)
  bool far_bias = false;   // learned far-pair logit terms for queries and keys (router_far_bias)
};

// Which projection scores the tokens: W_r (queries, and keys of symmetric routers) or W_k.
enum class RouterSide { Query, Key };

// Trainable parameters in one flat vector (for the optimizer), plus the gradient-free bias.
//   params = [ W_r (d_g x D, row-major) | C (G x d_g, row-major) | log_tau (only if learn_tau)
//              | W_k (d_g x D, only if key_proj) | f_q (D), b_q, f_k (D), b_k (only if far_bias) ]
struct RouterParams {
  RouterConfig cfg;
  std::vector<float> params;  // trainable
  std::vector<float> bias;    // [G] balancing bias b, updated without gradient (see BiasBalancer)

  int64_t w_r_offset() const { return 0; }
  int64_t centroids_offset() const { return cfg.d_g * cfg.dim; }
  int64_t log_tau_offset() const { return cfg.learn_tau ? centroids_offset() + cfg.groups * cfg.d_g : -1; }
  int64_t w_k_offset() const {
    return cfg.key_proj ? centroids_offset() + cfg.groups * cfg.d_g + (cfg.learn_tau ? 1 : 0) : 0;
  }
  int64_t size() const { return far_base() + (cfg.far_bias ? 2 * (cfg.dim + 1) : 0); }
  // The far-pair terms of `side`: D weights, then the offset b (-1 without far_bias).
  int64_t far_offset(RouterSide side) const {
    return cfg.far_bias ? far_base() + (side == RouterSide::Key ? cfg.dim + 1 : 0) : -1;
  }
  // Offset of the projection that scores `side` (W_r for both sides of a symmetric router).
  int64_t proj_offset(RouterSide side) const { return side == RouterSide::Key ? w_k_offset() : 0; }
  float* w_k() { return params.data() + w_k_offset(); }
  const float* w_k() const { return params.data() + w_k_offset(); }

  float* w_r() { return params.data(); }
  const float* w_r() const { return params.data(); }
  float* centroids() { return params.data() + centroids_offset(); }
  const float* centroids() const { return params.data() + centroids_offset(); }
  float tau() const;  // exp(log_tau) when learned, cfg.tau otherwise

 private:
  int64_t far_base() const {
    return centroids_offset() + cfg.groups * cfg.d_g + (cfg.learn_tau ? 1 : 0) + (cfg.key_proj ? cfg.d_g * cfg.dim : 0);
  }
};

// W_r ~ N(0, 1/D); centroids: random unit vectors; log_tau = log(cfg.tau); far-pair terms 0;
// bias = 0. Seeded.
RouterParams router_init(const RouterConfig& cfg, uint64_t seed);

// What router_backward needs from the forward pass.
struct RouterCache {
  int64_t n = 0;
  std::vector<float> r_hat;   // [N, d_g]  r_i / |r_i|
  std::vector<float> r_norm;  // [N]       |r_i|
  std::vector<float> c_hat;   // [G, d_g]  c_g / |c_g|
  std::vector<float> c_norm;  // [G]       |c_g|
  std::vector<float> s;       // [N, G]    scores
  std::vector<float> p;       // [N, G]    softmax(s + b)
};

// x [N, D] -> cache (s, p and the intermediates), scored by the projection of `side`. Without
// `probs` the softmax p is left empty (hard routing at inference reads only s and the bias).
// With `projected` (rows of RouterProjections::project for this router and side, row i at
// projected + i * projected_stride) x is not read; the scores are bitwise the same either way.
void router_forward(const RouterParams& rp, const float* x, int64_t n, RouterCache& cache,
                    RouterSide side = RouterSide::Query, bool probs = true, const float* projected = nullptr,
                    int64_t projected_stride = 0);

// The projections of several routers (and sides) that read the same input rows, kept transposed
// side by side by a caller whose routers do not change while it keeps them (inference): one pass
// over a row runs every projection's chains together, which decoding, one row at a time, needs
// to hide the FMA latency. Each number is bitwise the one router_forward computes from x.
struct RouterProjections {
  int64_t dim = 0, stride = 0;         // input width D; floats per projected row
  std::vector<int64_t> offset, width;  // per projection: its first float in a projected row, its d_g
  std::vector<int64_t> far;            // per far-pair term: its float in a projected row (<f, x>)
  std::vector<float> wt;               // [D, stride]
  // x [n, D] -> r [n, stride]: projection p of row i at r + i * stride + offset[p].
  void project(const float* x, int64_t n, float* r) const;
  // The same into a new array; empty when nothing is kept (stride 0).
  std::vector<float> rows(const float* x, int64_t n) const;
};
// The projections of `list`, then the far-pair terms' vectors f of `far` (cfg.far_bias), packed
// side by side after them.
RouterProjections router_projections(const std::vector<std::pair<const RouterParams*, RouterSide>>& list,
                                     const std::vector<std::pair<const RouterParams*, RouterSide>>& far = {});

// Given dL/dp [N, G] and/or dL/ds [N, G] (either may be null; ds is added to the gradient that
// flows from dp through the softmax), accumulates dL/dparams (same layout as rp.params) and,
// if dx is not null, dL/dx [N, D]. The bias b gets no gradient.
// `side` must be the forward's.
void router_backward(const RouterParams& rp, const float* x, const RouterCache& cache, const float* dp,
                     const float* ds, float* dparams, float* dx, RouterSide side = RouterSide::Query);

// Far-pair terms (cfg.far_bias): for each token of x [N, D], as a query or a key,
//   e_i = clamp(kFarBiasGain (<f, x_i> / sqrt(D) + b), -kFarBiasLimit, kFarBiasLimit)   -> e [N]
// A far pair (i, j) that the hard pattern reads gets the logit term e_query(i) + e_key(j): a
// learned down- (or up-) weighting of far keys per query and per key, zero at initialisation.
// The gain sets how fast the terms learn beside the routing parameters under one Adam step size:
// a step of lr on every weight moves e by up to about kFarBiasGain * lr * mean |x|.
inline constexpr float kFarBiasGain = 16.f;
inline constexpr float kFarBiasLimit = 30.f;
// <f, x_i> is one float32 FMA chain over d in order, as a kept projection's column computes it.
void router_far_bias(const RouterParams& rp, const float* x, int64_t n, RouterSide side, float* e);
// The same terms from rows projected by RouterProjections: <f, x_i> at projected[i * stride] (the
// term's column, RouterProjections::far); bitwise router_far_bias.
void router_far_bias_projected(const RouterParams& rp, RouterSide side, const float* projected, int64_t stride,
                               int64_t n, float* e);
// Given dL/de [N] and the forward's e, accumulates dL/d(f, b) into dparams and, if dx is not null,
// dL/dx [N, D] (a clamped e passes no gradient).
void router_far_bias_backward(const RouterParams& rp, const float* x, int64_t n, RouterSide side, const float* e,
                              const float* de, float* dparams, float* dx);

// Hard top-k membership (any k in [1, G]): the k best groups of logits_i + bias (bias may be null), written in
// ascending group order to groups [N, k]; ties go to the lower group index.
void router_topk(const float* logits, const float* bias, int64_t n, int64_t g, int k, int32_t* groups);

// Adaptive membership: for each token, the fewest best groups of softmax(logits_i + bias) whose
// probabilities sum to at least p (p in (0, 1]), at most kmax of them, written in ascending group
// order to groups [N, kmax] with -1 in the unused slots; ties go to the lower group index.
void router_topp(const float* logits, const float* bias, int64_t n, int64_t g, float p, int kmax, int32_t* groups);

}  // namespace focus
