// The transformer forward pass, shared by every architecture; ModelConfig says what differs.
#include <cmath>
#include <vector>

#include "core/error.h"
#include "focus/group_layout.h"
#include "focus/router.h"
#include "focus/sinkhorn.h"
#include "kernels/cpu/soft_attention.h"
#include "kernels/cpu/cached_attention.h"
#include "kernels/cpu/sparse_attention.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/ops.h"
#include "model/model.h"

namespace focus {

void KVCache::init(const ModelConfig& c, int64_t cap) {
  capacity = cap;
  len = 0;
  kv_dim = c.kv_dim();
  k.assign(c.layers, std::vector<float>(cap * kv_dim));
  v.assign(c.layers, std::vector<float>(cap * kv_dim));
  focus.clear();
}

void KVCache::truncate(int64_t n) {
  FOCUS_CHECK(n >= 0 && n <= len, "KVCache: cannot keep ", n, " of ", len, " positions");
  for (auto& f : focus)
    if (f.len > n) f.truncate(n);
  len = n;
}

namespace {

void norm(const ModelConfig& c, const float* x, const float* w, const float* b, float* out, int64_t rows) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm(x, w, out, rows, c.dim, c.norm_eps);
  else
    cpu::layernorm(x, w, b, out, rows, c.dim, c.norm_eps);
}

// The attention shape of a Focus layer over n tokens of this model.
cpu::AttnShape focus_shape(const ModelConfig& c, const FocusSettings& fs, int64_t n) {
  cpu::AttnShape s;
  s.n_q = s.n_kv = n;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.q_stride = c.q_dim();
  s.kv_stride = c.kv_dim();
  s.o_stride = c.q_dim();
  s.scale = c.attn_scale;
  s.local_window = fs.window;
  s.sinks = fs.sinks;
  s.groups = fs.groups;
  s.eps = fs.eps;
  return s;
}

// Routes the T new positions pos0 .. pos0+T-1 of layer l (soft assignments into rc, hard top-k
// memberships into groups [T, topk]) and appends them to the cache's routing of the layer.
// Window mode routes nothing.
void route_into_cache(const FocusRouters& F, const RouterParams& rp, const float* xn, int64_t T, int64_t pos0,
                      KVCache& cache, int64_t l, RouterCache& rc, std::vector<int32_t>& groups) {
  const FocusSettings& fs = F.settings;
  if ((int64_t)cache.focus.size() < (int64_t)cache.k.size()) cache.focus.resize(cache.k.size());
  if (fs.mode == FocusMode::Window) return;
  FocusLayerCache& fc = cache.focus[l];
  if (pos0 == 0) fc.reset(fs.groups, fs.topk);
  FOCUS_CHECK(fc.len == pos0 && fc.groups == fs.groups && fc.topk == fs.topk,
              "forward: the KV cache holds ", pos0, " positions but the Focus routing of ", fc.len,
              " of them (layer ", l, "); fill it from position 0 with the same routers");
  FOCUS_CHECK(fs.mode != FocusMode::Soft || pos0 == 0 || !fc.p.empty(),
              "forward: the KV cache was filled with hard routing; soft mode needs it filled in soft mode");
  router_forward(rp, xn, T, rc);
  groups.resize(T * fs.topk);
  router_topk(rc.s.data(), rp.bias.data(), T, fs.groups, fs.topk, groups.data());
  fc.append(groups.data(), fs.mode == FocusMode::Soft ? rc.p.data() : nullptr, T);
}

// Focus attention of one layer over positions 0 .. T-1, given the routing of those positions
// (rc: soft assignments; groups [T, topk]: hard memberships): the soft (biased), hard (sparse) or
// window kernel.
void focus_attention_layer(const ModelConfig& c, int64_t layer, const FocusRouters& F, const RouterCache& rc,
                           const std::vector<int32_t>& groups, const float* q, const float* k, const float* v,
                           float* att, int64_t T, FocusStats* stats) {
  const FocusSettings& fs = F.settings;
  if (fs.mode == FocusMode::Window) {
    const cpu::AttnShape s = focus_shape(c, fs, T);
    cpu::focus_window_attention(q, k, v, att, nullptr, s);
    if (stats) {
      const double w = (double)std::min(fs.window, T), S = (double)std::min(fs.sinks, T);
      // Window pairs, plus sink keys j < S outside the window of rows i >= w.
      double pairs = w * (w + 1) / 2 + (double)(T - (int64_t)w) * w;
      for (int64_t j = 0; j < (int64_t)S; ++j) pairs += (double)std::max<int64_t>(0, T - (j + fs.window));
      stats->computed_pairs += pairs;
      stats->causal_pairs += 0.5 * (double)T * (double)(T + 1);
      stats->layers++;
    }
    return;
  }
  if (fs.mode == FocusMode::Soft) {
    cpu::soft_attention_forward(q, k, v, rc.p.data(), att, nullptr, focus_shape(c, fs, T));
    return;
  }
  const Routing routing{groups.data(), fs.groups, fs.topk};
  const cpu::AttnShape s = focus_shape(c, fs, T);
  cpu::focus_attention_fused(q, k, v, att, nullptr, s, routing);
  if (stats && stats->groups) {
    if ((int64_t)stats->groups->size() < c.layers) stats->groups->resize(c.layers);
    (*stats->groups)[layer] = groups;
  }
  if (stats) {
    stats->computed_pairs += (double)cpu::focus_pair_count(routing, T, fs.window, fs.sinks);
    stats->causal_pairs += 0.5 * (double)T * (double)(T + 1);
    const GroupLoadStats g = group_load_stats(groups.data(), T, fs.topk, fs.groups);
    stats->load_max_over_mean = std::max(stats->load_max_over_mean, g.max_over_mean);
    stats->layers++;
  }
}

}  // namespace

void forward(const Model& m, const int32_t* ids, int64_t T, KVCache& cache, float* hidden, const FocusRouters* focus,
             FocusStats* stats) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim, pos0 = cache.len;
  FOCUS_CHECK(T > 0, "forward: empty input");
  FOCUS_CHECK(pos0 + T <= cache.capacity, "forward: ", pos0 + T, " positions exceed the cache capacity ",
              cache.capacity);
  if (c.learned_pos)
    FOCUS_CHECK(pos0 + T <= c.max_ctx, "forward: position ", pos0 + T - 1, " is beyond the model's ", c.max_ctx,
                " learned positions");

  std::vector<float> xn(T * D), q(T * c.q_dim()), att(T * c.q_dim()), tmp(T * D);
  std::vector<float> gate(T * c.ffn), up(T * c.ffn);
  RouterCache rcache;
  std::vector<int32_t> groups;
  float* x = hidden;  // the residual stream lives in the output buffer

  for (int64_t t = 0; t < T; ++t) {
    FOCUS_CHECK(ids[t] >= 0 && ids[t] < c.vocab, "forward: token id ", ids[t], " outside the vocabulary (", c.vocab,
                ")");
    const float* e = m.w.tok_emb + (int64_t)ids[t] * D;
    for (int64_t i = 0; i < D; ++i) x[t * D + i] = e[i] * c.embed_scale;
    if (c.learned_pos) {
      const float* p = m.w.pos_emb + (pos0 + t) * D;
      for (int64_t i = 0; i < D; ++i) x[t * D + i] += p[i];
    }
  }

  for (int64_t l = 0; l < c.layers; ++l) {
    const LayerWeights& L = m.w.layers[l];
    float* kc = cache.k[l].data() + pos0 * c.kv_dim();
    float* vc = cache.v[l].data() + pos0 * c.kv_dim();

    // Attention block.
    norm(c, x, L.attn_norm, L.attn_norm_b, xn.data(), T);
    cpu::linear(xn.data(), L.wq, L.bq, q.data(), T, D, c.q_dim());
    cpu::linear(xn.data(), L.wk, L.bk, kc, T, D, c.kv_dim());
    cpu::linear(xn.data(), L.wv, L.bv, vc, T, D, c.kv_dim());
    if (c.qk_norm) {
      cpu::rmsnorm(q.data(), L.q_norm, q.data(), T * c.heads, c.head_dim, c.norm_eps);
      cpu::rmsnorm(kc, L.k_norm, kc, T * c.kv_heads, c.head_dim, c.norm_eps);
    }
    const int64_t window = c.layer_window[l];
    if (c.rope_dim > 0) {
      const float theta = window > 0 ? c.rope_theta_local : c.rope_theta;
      cpu::rope(q.data(), T, c.heads, c.head_dim, c.rope_dim, pos0, theta, c.rope_style);
      cpu::rope(kc, T, c.kv_heads, c.head_dim, c.rope_dim, pos0, theta, c.rope_style);
    }
    const int64_t ri = (focus && focus->settings.mode != FocusMode::Off && window == 0) ? focus->router_of_layer[l] : -1;
    if (ri >= 0) route_into_cache(*focus, focus->routers[ri], xn.data(), T, pos0, cache, l, rcache, groups);
    if (ri >= 0 && pos0 + T > focus->settings.window) {
      if (pos0 == 0) {
        focus_attention_layer(c, l, *focus, rcache, groups, q.data(), cache.k[l].data(), cache.v[l].data(),
                              att.data(), T, stats);
      } else {
        const FocusSettings& fs = focus->settings;
        const int64_t pairs = cpu::focus_cached_attention(q.data(), cache.k[l].data(), cache.v[l].data(),
                                                          att.data(), focus_shape(c, fs, pos0 + T), pos0, T, fs.mode,
                                                          cache.focus[l], fs.eps);
        if (stats && fs.mode != FocusMode::Soft) {
          stats->computed_pairs += (double)pairs;
          stats->causal_pairs += (double)T * (double)pos0 + 0.5 * (double)T * (double)(T + 1);
          stats->layers++;
        }
      }
    } else {
      cpu::AttnShape s{T, pos0 + T, pos0, c.heads, c.kv_heads, c.head_dim, c.q_dim(), c.kv_dim(), c.q_dim(),
                       c.attn_scale, window};
      cpu::flash_attention(q.data(), cache.k[l].data(), cache.v[l].data(), att.data(), nullptr, s);
    }
    cpu::linear(att.data(), L.wo, L.bo, tmp.data(), T, c.q_dim(), D);
    if (c.post_norms) cpu::rmsnorm(tmp.data(), L.post_attn_norm, tmp.data(), T, D, c.norm_eps);
    cpu::add_inplace(x, tmp.data(), T * D);

    // MLP block.
    norm(c, x, L.ffn_norm, L.ffn_norm_b, xn.data(), T);
    if (c.mlp == MlpKind::GELU) {
      cpu::linear(xn.data(), L.w_up, L.b_up, up.data(), T, D, c.ffn);
      cpu::gelu_tanh(up.data(), T * c.ffn);
      cpu::linear(up.data(), L.w_down, L.b_down, tmp.data(), T, c.ffn, D);
    } else {
      cpu::linear(xn.data(), L.w_gate, nullptr, gate.data(), T, D, c.ffn);
      cpu::linear(xn.data(), L.w_up, L.b_up, up.data(), T, D, c.ffn);
      if (c.mlp == MlpKind::SwiGLU)
        cpu::silu_mul(gate.data(), up.data(), T * c.ffn);
      else
        cpu::gelu_tanh_mul(gate.data(), up.data(), T * c.ffn);
      cpu::linear(gate.data(), L.w_down, L.b_down, tmp.data(), T, c.ffn, D);
    }
    if (c.post_norms) cpu::rmsnorm(tmp.data(), L.post_ffn_norm, tmp.data(), T, D, c.norm_eps);
    cpu::add_inplace(x, tmp.data(), T * D);
  }
  norm(c, x, m.w.out_norm, m.w.out_norm_b, x, T);
  cache.len = pos0 + T;
  cpu::focus_attention_trim_scratch(kAttentionScratchKept);
}

void compute_logits(const Model& m, const float* hidden, int64_t rows, float* logits) {
  cpu::linear(hidden, m.w.lm_head, nullptr, logits, rows, m.cfg.dim, m.cfg.vocab);
}

std::string to_string(Arch a) {
  switch (a) {
    case Arch::Llama: return "llama";
    case Arch::Gemma3: return "gemma3";
    case Arch::GPT2: return "gpt2";
  }
  return "?";
}

}  // namespace focus
