// Tiny random models of each architecture (Llama with GQA, Gemma 3 with sliding-window layers,
// QK norms and post norms, GPT-2 with biases and learned positions) for gradient checks.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "focus/block_budget.h"
#include "focus/block_topk.h"
#include "focus/focus_model.h"
#include "model/attention.h"
#include "model/model.h"

namespace focus::test {

// Hard asymmetric routers: d_g 8, tau 0.5, 1 sink, the given groups, top-k and window.
inline FocusSettings asym_settings(int64_t groups, int topk, int64_t window) {
  FocusSettings s;
  s.asymmetric = true;
  s.groups = groups;
  s.dg = 8;
  s.topk = topk;
  s.local_window = window;
  s.sinks = 1;
  s.tau = 0.5f;
  s.mode = FocusMode::Hard;
  return s;
}

// A block budget of blocks of 4, a 5-token window and 1 sink with the given per-head counts.
inline BlockBudget small_budget(std::vector<std::vector<int64_t>> k) {
  BlockBudget b;
  b.block = 4;
  b.window = 5;
  b.sinks = 1;
  b.k = std::move(k);
  return b;
}

// One global layer of 4 query heads on 2 kv heads of 8 dimensions (attention kernel tests).
inline ModelConfig one_global_layer_config() {
  ModelConfig c;
  c.layers = 1;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.attn_scale = 1.f / std::sqrt(8.f);
  c.layer_sliding_window = {0};
  return c;
}

// Attention probabilities of row p, query head h over keys 0 .. p of float q and k (rows of c's
// q_dim and kv_dim), in float64: the reference for what block selections miss.
inline std::vector<double> softmax_row(const std::vector<float>& q, const std::vector<float>& k, const ModelConfig& c,
                                       int64_t p, int64_t h) {
  const int64_t hd = c.head_dim, g = h / (c.heads / c.kv_heads);
  std::vector<double> e(p + 1);
  double mx = -INFINITY, z = 0;
  for (int64_t j = 0; j <= p; ++j) {
    double d = 0;
    for (int64_t y = 0; y < hd; ++y) d += (double)q[p * c.q_dim() + h * hd + y] * k[j * c.kv_dim() + g * hd + y];
    mx = std::max(mx, e[j] = d * c.attn_scale);
  }
  for (double& x : e) z += (x = std::exp(x - mx));
  for (double& x : e) x /= z;
  return e;
}

// The call of rows pos0 .. pos0+T-1 of q over the keys k (values and output not set).
inline AttentionCall rows_call(const ModelConfig& c, const std::vector<float>& q, const std::vector<float>& k,
                               int64_t pos0, int64_t T) {
  AttentionCall a;
  a.cfg = &c;
  a.pos0 = pos0;
  a.T = T;
  a.q = q.data() + pos0 * c.q_dim();
  a.k = k.data();
  return a;
}

// Block top-k's selection for rows 0 .. n-1 of q over the keys k (bounds in st), every head with N
// near and K ranked blocks of B keys beyond a window of w and S sinks: the slots per row and head
// in sel, their count returned.
inline int select_blocks(const ModelConfig& c, const std::vector<float>& q, const std::vector<float>& k, int64_t n,
                         BlockTopKState& st, int64_t B, int64_t w, int64_t S, int64_t N, int64_t K,
                         std::vector<int32_t>& sel) {
  BlockTopKSettings s;
  s.block = B;
  s.window = w;
  s.sinks = S;
  s.set_head_k(std::vector<int64_t>(c.heads, K), std::vector<int64_t>(c.heads, N));
  return block_topk_select(rows_call(c, q, k, 0, n), st, s, sel);
}

inline std::vector<float> random_normal(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// vocab 50, dim 32, 3 layers, 4 heads (2 kv heads except GPT-2), head dim 8, ffn 48, 64 positions.
inline std::unique_ptr<Model> random_model(Arch arch, uint32_t seed) {
  auto m = std::make_unique<Model>();
  ModelConfig& c = m->cfg;
  c.arch = arch;
  c.vocab = 50;
  c.dim = 32;
  c.layers = 3;
  c.heads = 4;
  c.kv_heads = arch == Arch::GPT2 ? 4 : 2;
  c.head_dim = 8;
  c.ffn = 48;
  c.max_ctx = 64;
  c.norm_eps = 1e-5f;
  c.attn_scale = 1.f / std::sqrt(8.f);
  c.layer_sliding_window.assign(c.layers, 0);
  if (arch == Arch::Llama) {
    c.rope_dim = 8;
    c.rope_style = cpu::RopeStyle::Interleaved;
  } else if (arch == Arch::Gemma3) {
    c.rope_dim = 8;
    c.rope_style = cpu::RopeStyle::SplitHalf;
    c.rope_theta_local = 1000.f;
    c.mlp = MlpKind::GeGLU;
    c.qk_norm = true;
    c.post_norms = true;
    c.embed_scale = std::sqrt(32.f);
    c.layer_sliding_window = {5, 0, 5};  // local, global, local
  } else {
    c.norm = NormKind::Layer;
    c.mlp = MlpKind::GELU;
    c.learned_pos = true;
  }
  uint32_t s = seed;
  auto mat = [&](int64_t n, float scale) { return m->w.keep(random_normal(n, ++s, scale)); };
  auto matrix = [&](int64_t rows, int64_t cols, float scale) { return Weight::f32(mat(rows * cols, scale), rows, cols); };
  auto normw = [&](int64_t n) {
    auto v = random_normal(n, ++s, 0.1f);
    for (auto& x : v) x += 1.f;
    return m->w.keep(v);
  };
  const bool bias = arch == Arch::GPT2;
  const float ws = 1.f / std::sqrt((float)c.dim);
  m->w.tok_emb = matrix(c.vocab, c.dim, arch == Arch::Gemma3 ? 0.2f : 1.f);
  if (c.learned_pos) m->w.pos_emb = mat(c.max_ctx * c.dim, 0.3f);
  m->w.out_norm = normw(c.dim);
  if (bias) m->w.out_norm_b = mat(c.dim, 0.1f);
  m->w.lm_head = m->w.tok_emb;
  for (int64_t l = 0; l < c.layers; ++l) {
    LayerWeights L;
    L.attn_norm = normw(c.dim);
    L.wq = matrix(c.q_dim(), c.dim, ws);
    L.wk = matrix(c.kv_dim(), c.dim, ws);
    L.wv = matrix(c.kv_dim(), c.dim, ws);
    L.wo = matrix(c.dim, c.q_dim(), ws);
    L.ffn_norm = normw(c.dim);
    L.w_up = matrix(c.ffn, c.dim, ws);
    L.w_down = matrix(c.dim, c.ffn, 1.f / std::sqrt((float)c.ffn));
    if (c.mlp != MlpKind::GELU) L.w_gate = matrix(c.ffn, c.dim, ws);
    if (bias) {
      L.attn_norm_b = mat(c.dim, 0.1f);
      L.ffn_norm_b = mat(c.dim, 0.1f);
      L.bq = mat(c.q_dim(), 0.1f);
      L.bk = mat(c.kv_dim(), 0.1f);
      L.bv = mat(c.kv_dim(), 0.1f);
      L.bo = mat(c.dim, 0.1f);
      L.b_up = mat(c.ffn, 0.1f);
      L.b_down = mat(c.dim, 0.1f);
    }
    if (c.qk_norm) {
      L.q_norm = normw(c.head_dim);
      L.k_norm = normw(c.head_dim);
    }
    if (c.post_norms) {
      L.post_attn_norm = normw(c.dim);
      L.post_ffn_norm = normw(c.dim);
    }
    m->w.layers.push_back(L);
  }
  return m;
}

// A training window of T random ids (seeded) predicting the next id, with row 3 unscored.
struct Win {
  std::vector<int32_t> ids, targets;
};
inline Win window_of(int64_t T, int64_t vocab, uint32_t seed) {
  std::mt19937 g(seed);
  Win w;
  for (int64_t t = 0; t < T; ++t) w.ids.push_back((int32_t)(g() % vocab));
  for (int64_t t = 0; t < T; ++t) w.targets.push_back(t + 1 < T ? w.ids[t + 1] : -1);
  w.targets[3] = -1;  // an unscored row in the middle
  return w;
}

// Final-normed hidden states [n, dim] of one forward pass over ids from position 0, with the
// plan's attention (null: the model's own) and its pattern statistics (may be null).
inline std::vector<float> hidden_of(const Model& m, const std::vector<int32_t>& ids, const AttentionPlan* plan,
                                    AttentionStats* st = nullptr) {
  KVCache c;
  c.init(m.cfg, (int64_t)ids.size());
  std::vector<float> h(ids.size() * m.cfg.dim);
  forward(m, ids.data(), (int64_t)ids.size(), c, h.data(), plan, st);
  return h;
}

// The hidden states of ids decoded from a KV cache of element type t: a prefill of `prefill`
// tokens, a rollback to `keep` (keep <= prefill), then one token at a time. The prefill reads
// prefill_ids when given (other tokens after `keep`: what the rollback must forget).
inline std::vector<float> hidden_decoded(const Model& m, const std::vector<int32_t>& ids, const AttentionPlan* plan,
                                         int64_t prefill, int64_t keep, cpu::KvType t = cpu::KvType::F32,
                                         const std::vector<int32_t>* prefill_ids = nullptr) {
  const int64_t n = (int64_t)ids.size(), D = m.cfg.dim;
  KVCache c;
  c.init(m.cfg, n, t);
  std::vector<float> h(n * D);
  forward(m, (prefill_ids ? *prefill_ids : ids).data(), prefill, c, h.data(), plan);
  c.truncate(keep);
  for (int64_t i = keep; i < n; ++i) forward(m, ids.data() + i, 1, c, h.data() + i * D, plan);
  return h;
}

// Largest |a[i] - b[i]| over i in [from, min(size, to)).
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b, size_t from = 0,
                           size_t to = SIZE_MAX) {
  double e = 0;
  for (size_t i = from; i < std::min(a.size(), to); ++i) e = std::max(e, (double)std::fabs(a[i] - b[i]));
  return e;
}

// The gradient g (blocks of floats) against a central difference of the loss along g / |g|, which
// must equal |g|. loss_with_step(s) is the loss with s * g added to the parameters.
template <class LossWithStep>
void expect_directional_derivative(const std::vector<std::vector<float>>& g, LossWithStep&& loss_with_step) {
  double gn = 0;
  for (auto& v : g)
    for (float x : v) gn += (double)x * x;
  gn = std::sqrt(gn);
  ASSERT_GT(gn, 1e-4);
  const double h = 1e-2;
  const double fd = (loss_with_step(h / gn) - loss_with_step(-h / gn)) / (2 * h);
  EXPECT_NEAR(fd, gn, 2e-3 * gn + 1e-4) << "directional derivative";
}

}  // namespace focus::test
