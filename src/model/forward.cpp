// The transformer forward pass, shared by every architecture; ModelConfig says what differs.
#include <cmath>
#include <vector>

#include "core/error.h"
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
}

namespace {

void norm(const ModelConfig& c, const float* x, const float* w, const float* b, float* out, int64_t rows) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm(x, w, out, rows, c.dim, c.norm_eps);
  else
    cpu::layernorm(x, w, b, out, rows, c.dim, c.norm_eps);
}

}  // namespace

void forward(const Model& m, const int32_t* ids, int64_t T, KVCache& cache, float* hidden) {
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
    cpu::AttnShape s{T, pos0 + T, pos0, c.heads, c.kv_heads, c.head_dim, c.q_dim(), c.kv_dim(), c.q_dim(),
                     c.attn_scale, window};
    cpu::flash_attention(q.data(), cache.k[l].data(), cache.v[l].data(), att.data(), nullptr, s);
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
