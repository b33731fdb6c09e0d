#include "train/backward.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "focus/soft_attention.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/ops_backward.h"

namespace focus {
namespace {

// Everything one layer's backward pass needs from its forward pass.
struct LayerActs {
  std::vector<float> xn1;           // attention norm output [T, D]
  std::vector<float> q_pre, k_pre;  // q, k before the QK norms (Gemma 3)
  std::vector<float> q, k, v;       // as the attention kernel saw them (normed, rotated)
  std::vector<float> att, lse;      // attention output [T, q_dim], log-sum-exp [H, T]
  std::vector<float> a_pre;         // attention projection before the post-attention norm
  std::vector<float> h1;            // residual after the attention block [T, D]
  std::vector<float> xn2;           // MLP norm output
  std::vector<float> gate, up;      // MLP pre-activations [T, ffn] (GELU: up only)
  std::vector<float> act;           // MLP activation output [T, ffn]
  std::vector<float> m_pre;         // MLP projection before the post-MLP norm
  RouterCache rc;                   // router layers only
};

// Bytes of one layer's activations (for the keep-or-recompute decision).
double layer_act_bytes(const ModelConfig& c, int64_t T, int64_t G) {
  double f = (double)T * (c.dim * 4 + c.q_dim() * 2 + c.kv_dim() * 2 + c.ffn * 3 + c.heads + G * 2);
  if (c.qk_norm) f += (double)T * (c.q_dim() + c.kv_dim());
  if (c.post_norms) f += (double)T * c.dim * 2;
  return 4 * f;
}

void norm_fwd(const ModelConfig& c, const float* x, const float* w, const float* b, float* out, int64_t rows) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm(x, w, out, rows, c.dim, c.norm_eps);
  else
    cpu::layernorm(x, w, b, out, rows, c.dim, c.norm_eps);
}

void norm_bwd(const ModelConfig& c, const float* x, const float* w, const float* dy, float* dx, int64_t rows,
              bool accumulate) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm_backward(x, w, dy, dx, rows, c.dim, c.norm_eps, accumulate);
  else
    cpu::layernorm_backward(x, w, dy, dx, rows, c.dim, c.norm_eps, accumulate);
}

SoftAttnShape attn_shape(const ModelConfig& c, const FocusRouters& f, int64_t l, int64_t T) {
  SoftAttnShape s;
  s.n = T;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.groups = f.settings.groups;
  s.window = f.settings.window;
  s.sinks = f.settings.sinks;
  s.scale = c.attn_scale;
  s.eps = f.settings.eps;
  s.sliding_window = c.layer_window[l];
  return s;
}

const RouterParams* router_of(const FocusRouters& f, int64_t l) {
  const int64_t r = l < (int64_t)f.router_of_layer.size() ? f.router_of_layer[l] : -1;
  return r >= 0 ? &f.routers[r] : nullptr;
}

// One layer forward from x_in to x_out (may alias), filling A.
void layer_forward(const Model& m, const FocusRouters& f, int64_t l, int64_t T, const float* x_in, float* x_out,
                   LayerActs& A) {
  const ModelConfig& c = m.cfg;
  const LayerWeights& L = m.w.layers[l];
  const int64_t D = c.dim, QD = c.q_dim(), KD = c.kv_dim(), F = c.ffn;
  A.xn1.resize(T * D);
  A.q.resize(T * QD);
  A.k.resize(T * KD);
  A.v.resize(T * KD);
  A.att.resize(T * QD);
  A.lse.resize(c.heads * T);
  A.h1.resize(T * D);
  A.xn2.resize(T * D);
  A.act.resize(T * F);

  norm_fwd(c, x_in, L.attn_norm, L.attn_norm_b, A.xn1.data(), T);
  cpu::linear(A.xn1.data(), L.wq, L.bq, A.q.data(), T, D, QD);
  cpu::linear(A.xn1.data(), L.wk, L.bk, A.k.data(), T, D, KD);
  cpu::linear(A.xn1.data(), L.wv, L.bv, A.v.data(), T, D, KD);
  if (c.qk_norm) {
    A.q_pre = A.q;
    A.k_pre = A.k;
    cpu::rmsnorm(A.q_pre.data(), L.q_norm, A.q.data(), T * c.heads, c.head_dim, c.norm_eps);
    cpu::rmsnorm(A.k_pre.data(), L.k_norm, A.k.data(), T * c.kv_heads, c.head_dim, c.norm_eps);
  }
  if (c.rope_dim > 0) {
    const float theta = c.layer_window[l] > 0 ? c.rope_theta_local : c.rope_theta;
    cpu::rope(A.q.data(), T, c.heads, c.head_dim, c.rope_dim, 0, theta, c.rope_style);
    cpu::rope(A.k.data(), T, c.kv_heads, c.head_dim, c.rope_dim, 0, theta, c.rope_style);
  }
  const RouterParams* rp = router_of(f, l);
  if (rp) router_forward(*rp, A.xn1.data(), T, A.rc);
  soft_attention_forward(A.q.data(), A.k.data(), A.v.data(), rp ? A.rc.p.data() : nullptr, A.att.data(),
                         A.lse.data(), attn_shape(c, f, l, T));

  // Attention projection and residual: h1 = x_in + post_norm(att Wo^T + bo).
  std::vector<float>& a = c.post_norms ? A.a_pre : A.h1;
  a.resize(T * D);
  cpu::linear(A.att.data(), L.wo, L.bo, a.data(), T, QD, D);
  if (c.post_norms) cpu::rmsnorm(A.a_pre.data(), L.post_attn_norm, A.h1.data(), T, D, c.norm_eps);
  cpu::add_inplace(A.h1.data(), x_in, T * D);

  // MLP block.
  norm_fwd(c, A.h1.data(), L.ffn_norm, L.ffn_norm_b, A.xn2.data(), T);
  A.up.resize(T * F);
  if (c.mlp == MlpKind::GELU) {
    cpu::linear(A.xn2.data(), L.w_up, L.b_up, A.up.data(), T, D, F);
    std::copy(A.up.begin(), A.up.end(), A.act.begin());
    cpu::gelu_tanh(A.act.data(), T * F);
  } else {
    A.gate.resize(T * F);
    cpu::linear(A.xn2.data(), L.w_gate, nullptr, A.gate.data(), T, D, F);
    cpu::linear(A.xn2.data(), L.w_up, L.b_up, A.up.data(), T, D, F);
    std::copy(A.gate.begin(), A.gate.end(), A.act.begin());
    if (c.mlp == MlpKind::SwiGLU)
      cpu::silu_mul(A.act.data(), A.up.data(), T * F);
    else
      cpu::gelu_tanh_mul(A.act.data(), A.up.data(), T * F);
  }
  if (c.post_norms) {
    A.m_pre.resize(T * D);
    cpu::linear(A.act.data(), L.w_down, L.b_down, A.m_pre.data(), T, F, D);
    cpu::rmsnorm(A.m_pre.data(), L.post_ffn_norm, x_out, T, D, c.norm_eps);
  } else {
    cpu::linear(A.act.data(), L.w_down, L.b_down, x_out, T, F, D);
  }
  cpu::add_inplace(x_out, A.h1.data(), T * D);
}

// Scratch of the backward pass, reused across layers.
struct BackScratch {
  std::vector<float> d1, dact, dgate, dup, dxn, dh1, datt, dq, dk, dv, dp, ds, tmp;
};

// Given dx = dL/dx_out [T, D] and layer l's input x_in and activations, replaces dx with
// dL/dx_in and accumulates the router's parameter gradient.
void layer_backward(const Model& m, const FocusRouters& f, int64_t l, int64_t T, const float* x_in,
                    const LayerActs& A, float* dx, std::vector<std::vector<float>>& grads, const RouterAuxHook& hook,
                    BackScratch& S) {
  const ModelConfig& c = m.cfg;
  const LayerWeights& L = m.w.layers[l];
  const int64_t D = c.dim, QD = c.q_dim(), KD = c.kv_dim(), F = c.ffn;

  // MLP block: x_out = h1 + post(down(act)).
  const float* dm = dx;
  if (c.post_norms) {
    S.d1.resize(T * D);
    cpu::rmsnorm_backward(A.m_pre.data(), L.post_ffn_norm, dx, S.d1.data(), T, D, c.norm_eps, false);
    dm = S.d1.data();
  }
  S.dact.resize(T * F);
  cpu::linear_backward_input(dm, L.w_down, S.dact.data(), T, F, D, false);
  S.dup.resize(T * F);
  S.dxn.resize(T * D);
  if (c.mlp == MlpKind::GELU) {
    cpu::gelu_tanh_backward(A.up.data(), S.dact.data(), S.dup.data(), T * F);
    cpu::linear_backward_input(S.dup.data(), L.w_up, S.dxn.data(), T, D, F, false);
  } else {
    S.dgate.resize(T * F);
    if (c.mlp == MlpKind::SwiGLU)
      cpu::silu_mul_backward(A.gate.data(), A.up.data(), S.dact.data(), S.dgate.data(), S.dup.data(), T * F);
    else
      cpu::gelu_tanh_mul_backward(A.gate.data(), A.up.data(), S.dact.data(), S.dgate.data(), S.dup.data(), T * F);
    cpu::linear_backward_input(S.dgate.data(), L.w_gate, S.dxn.data(), T, D, F, false);
    cpu::linear_backward_input(S.dup.data(), L.w_up, S.dxn.data(), T, D, F, true);
  }
  // dh1 = dx + norm'(h1) dxn  (kept in dx)
  norm_bwd(c, A.h1.data(), L.ffn_norm, S.dxn.data(), dx, T, true);

  // Attention block: h1 = x_in + post(att Wo^T).
  const float* da = dx;
  if (c.post_norms) {
    S.d1.resize(T * D);
    cpu::rmsnorm_backward(A.a_pre.data(), L.post_attn_norm, dx, S.d1.data(), T, D, c.norm_eps, false);
    da = S.d1.data();
  }
  S.datt.resize(T * QD);
  cpu::linear_backward_input(da, L.wo, S.datt.data(), T, QD, D, false);

  const RouterParams* rp = router_of(f, l);
  const int64_t G = f.settings.groups;
  S.dq.assign(T * QD, 0.f);
  S.dk.assign(T * KD, 0.f);
  S.dv.assign(T * KD, 0.f);
  if (rp) S.dp.assign(T * G, 0.f);
  soft_attention_backward(A.q.data(), A.k.data(), A.v.data(), rp ? A.rc.p.data() : nullptr, A.att.data(),
                          A.lse.data(), S.datt.data(), S.dq.data(), S.dk.data(), S.dv.data(),
                          rp ? S.dp.data() : nullptr, attn_shape(c, f, l, T));
  if (c.rope_dim > 0) {
    const float theta = c.layer_window[l] > 0 ? c.rope_theta_local : c.rope_theta;
    cpu::rope_backward(S.dq.data(), T, c.heads, c.head_dim, c.rope_dim, 0, theta, c.rope_style);
    cpu::rope_backward(S.dk.data(), T, c.kv_heads, c.head_dim, c.rope_dim, 0, theta, c.rope_style);
  }
  if (c.qk_norm) {
    cpu::rmsnorm_backward(A.q_pre.data(), L.q_norm, S.dq.data(), S.dq.data(), T * c.heads, c.head_dim, c.norm_eps,
                          false);
    cpu::rmsnorm_backward(A.k_pre.data(), L.k_norm, S.dk.data(), S.dk.data(), T * c.kv_heads, c.head_dim,
                          c.norm_eps, false);
  }
  S.dxn.resize(T * D);
  cpu::linear_backward_input(S.dq.data(), L.wq, S.dxn.data(), T, D, QD, false);
  cpu::linear_backward_input(S.dk.data(), L.wk, S.dxn.data(), T, D, KD, true);
  cpu::linear_backward_input(S.dv.data(), L.wv, S.dxn.data(), T, D, KD, true);
  if (rp) {
    const int64_t r = f.router_of_layer[l];
    S.ds.assign(T * G, 0.f);
    if (hook) hook(r, A.rc, S.ds.data());
    router_backward(*rp, A.xn1.data(), A.rc, S.dp.data(), S.ds.data(), grads[r].data(), S.dxn.data());
  }
  // dx_in = dh1 + norm'(x_in) dxn1
  norm_bwd(c, x_in, L.attn_norm, S.dxn.data(), dx, T, true);
}

void embed(const Model& m, const int32_t* ids, int64_t T, float* x) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim;
  for (int64_t t = 0; t < T; ++t) {
    FOCUS_CHECK(ids[t] >= 0 && ids[t] < c.vocab, "training window: token id ", ids[t], " outside the vocabulary (",
                c.vocab, ")");
    const float* e = m.w.tok_emb + (int64_t)ids[t] * D;
    for (int64_t i = 0; i < D; ++i) x[t * D + i] = e[i] * c.embed_scale;
    if (c.learned_pos) {
      const float* p = m.w.pos_emb + t * D;
      for (int64_t i = 0; i < D; ++i) x[t * D + i] += p[i];
    }
  }
}

// Cross-entropy head over the final residual x [T, D]: returns the NLL sum; when dx is not null,
// writes dL/dx (L = loss_scale * NLL sum). Logits are made in row chunks (no [T, vocab] buffer).
double head_loss(const Model& m, const float* x, const TrainWindow& w, float loss_scale, float* dx, int64_t* scored) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim, V = c.vocab, T = w.T;
  std::vector<float> h(T * D);
  norm_fwd(c, x, m.w.out_norm, m.w.out_norm_b, h.data(), T);
  const int64_t chunk = std::clamp<int64_t>((int64_t)(16 << 20) / std::max<int64_t>(V, 1), 8, 256);
  std::vector<float> logits(chunk * V);
  std::vector<float> dh(dx ? T * D : 0);
  double nll = 0;
  int64_t n = 0;
  for (int64_t r0 = 0; r0 < T; r0 += chunk) {
    const int64_t rows = std::min(chunk, T - r0);
    cpu::linear(h.data() + r0 * D, m.w.lm_head, nullptr, logits.data(), rows, D, V);
    double part = 0;
    int64_t cnt = 0;
#pragma omp parallel for schedule(static) reduction(+ : part, cnt)
    for (int64_t r = 0; r < rows; ++r) {
      float* lr = logits.data() + r * V;
      const int32_t tgt = w.targets[r0 + r];
      if (tgt < 0) {
        if (dx) std::fill(lr, lr + V, 0.f);
        continue;
      }
      float mx = lr[0];
      for (int64_t i = 1; i < V; ++i) mx = std::max(mx, lr[i]);
      double s = 0;
      for (int64_t i = 0; i < V; ++i) s += std::exp((double)lr[i] - mx);
      const double lse = mx + std::log(s);
      part += lse - lr[tgt];
      ++cnt;
      if (dx) {
        for (int64_t i = 0; i < V; ++i) lr[i] = (float)(std::exp((double)lr[i] - lse) * loss_scale);
        lr[tgt] -= loss_scale;
      }
    }
    nll += part;
    n += cnt;
    if (dx) cpu::linear_backward_input(logits.data(), m.w.lm_head, dh.data() + r0 * D, rows, D, V, false);
  }
  if (dx) norm_bwd(c, x, m.w.out_norm, dh.data(), dx, T, false);
  if (scored) *scored = n;
  return nll;
}

void check_window(const Model& m, const FocusRouters& f, const TrainWindow& w) {
  const ModelConfig& c = m.cfg;
  FOCUS_CHECK(w.T > 0 && w.ids && w.targets, "training window: empty");
  if (c.learned_pos)
    FOCUS_CHECK(w.T <= c.max_ctx, "training window of ", w.T, " tokens is longer than the model's ", c.max_ctx,
                " learned positions");
  FOCUS_CHECK((int64_t)f.router_of_layer.size() == c.layers, "routers: ", f.router_of_layer.size(),
              " layer entries for a model of ", c.layers, " layers");
  for (int64_t t = 0; t < w.T; ++t)
    FOCUS_CHECK(w.targets[t] < c.vocab, "training window: target id ", w.targets[t], " outside the vocabulary (",
                c.vocab, ")");
}

}  // namespace

LossGrad focus_router_loss_and_grad(const Model& m, const FocusRouters& f, const TrainWindow& w, float loss_scale,
                                    std::vector<std::vector<float>>* grads, const RouterAuxHook& hook,
                                    const BackwardOptions& opt) {
  const ModelConfig& c = m.cfg;
  check_window(m, f, w);
  const int64_t T = w.T, D = c.dim, NL = c.layers;
  if (grads) {
    FOCUS_CHECK(grads->size() == f.routers.size(), "router gradients: ", grads->size(), " buffers for ",
                f.routers.size(), " routers");
    for (size_t r = 0; r < f.routers.size(); ++r)
      FOCUS_CHECK((*grads)[r].size() == f.routers[r].params.size(), "router gradient ", r, " has the wrong size");
  }
  // Layers below the lowest router need no backward pass.
  int64_t first = NL;
  for (int64_t l = 0; l < NL; ++l)
    if (router_of(f, l)) {
      first = l;
      break;
    }
  const bool need_grad = grads && first < NL;
  const bool recompute = opt.force_recompute >= 0
                             ? opt.force_recompute == 1
                             : layer_act_bytes(c, T, f.settings.groups) * (NL - first) > opt.keep_activations_bytes;

  // Forward: xs[l] is layer l's input; xs[NL] the final residual.
  std::vector<std::vector<float>> xs(NL + 1);
  xs[0].resize(T * D);
  embed(m, w.ids, T, xs[0].data());
  std::vector<LayerActs> kept(need_grad && !recompute ? NL : 0);
  LayerActs scratch;
  for (int64_t l = 0; l < NL; ++l) {
    xs[l + 1].resize(T * D);
    LayerActs& A = (need_grad && !recompute && l >= first) ? kept[l] : scratch;
    layer_forward(m, f, l, T, xs[l].data(), xs[l + 1].data(), A);
    // Inputs of layers below the first router are not needed again.
    if (need_grad && l < first) std::vector<float>().swap(xs[l]);
  }

  LossGrad res;
  std::vector<float> dx(need_grad ? T * D : 0);
  res.loss_sum = head_loss(m, xs[NL].data(), w, loss_scale, need_grad ? dx.data() : nullptr, &res.scored);
  if (!need_grad) return res;

  BackScratch S;
  for (int64_t l = NL - 1; l >= first; --l) {
    const LayerActs* A = nullptr;
    if (recompute) {
      std::vector<float> out(T * D);
      layer_forward(m, f, l, T, xs[l].data(), out.data(), scratch);
      A = &scratch;
    } else {
      A = &kept[l];
    }
    layer_backward(m, f, l, T, xs[l].data(), *A, dx.data(), *grads, hook, S);
    if (!recompute) kept[l] = LayerActs();
    std::vector<float>().swap(xs[l + 1]);
  }
  return res;
}

double focus_router_loss(const Model& m, const FocusRouters& f, const TrainWindow& w, int64_t* scored) {
  const LossGrad r = focus_router_loss_and_grad(m, f, w, 1.0f, nullptr);
  if (scored) *scored = r.scored;
  return r.loss_sum;
}

}  // namespace focus
