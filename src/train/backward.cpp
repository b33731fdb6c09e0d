#include "train/backward.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "kernels/cpu/soft_attention.h"
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
  std::array<std::vector<float>, kLoraTargets> lora_u;  // adapted projections: (alpha/r) x A^T [T, r]
};

// What the layer passes see of the trainable set: the routers (possibly none) and the adapters.
struct Parts {
  const FocusRouters& f;
  const LoraAdapters* lora;
  const LoraMatrix* adapter(int64_t l, int target) const { return lora ? lora->find(l, target) : nullptr; }
  bool adapted(int64_t l) const {
    for (int t = 0; t < kLoraTargets; ++t)
      if (adapter(l, t)) return true;
    return false;
  }
};

// Bytes of one layer's activations (for the keep-or-recompute decision).
double layer_act_bytes(const ModelConfig& c, int64_t T, int64_t G, int64_t lora_cols) {
  double f = (double)T * (c.dim * 4 + c.q_dim() * 2 + c.kv_dim() * 2 + c.ffn * 3 + c.heads + G * 2 + lora_cols);
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

cpu::AttnShape attn_shape(const ModelConfig& c, const FocusRouters& f, int64_t l, int64_t T) {
  cpu::AttnShape s;
  s.n_q = s.n_kv = T;
  s.heads = c.heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.groups = f.settings.groups;
  s.local_window = f.settings.window;
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

// y [T, out] += (alpha / r) (x A^T) B^T for the adapter of (l, target), if any; u keeps the
// scaled (alpha / r) x A^T for the backward pass.
void lora_forward(const Parts& P, int64_t l, int target, const float* x, int64_t T, float* y, std::vector<float>& u) {
  const LoraMatrix* a = P.adapter(l, target);
  if (!a) return;
  const float s = P.lora->settings.scale();
  u.resize(T * a->rank);
  cpu::linear(x, a->a(), nullptr, u.data(), T, a->in, a->rank);
  for (float& v : u) v *= s;
  cpu::linear_acc(u.data(), a->b(), y, T, a->rank, a->out);
}

// Backward of lora_forward given dy = dL/dy [T, out]: adds the adapter's part of dL/dx into dx
// and, when the adapters are trained (grads not null), accumulates dL/dA and dL/dB into the
// adapter's gradient (laid out like its params).
//   dB += dy^T u      du = (alpha / r) dy B      dA += du^T x      dx += du A
void lora_backward(const Parts& P, int64_t l, int target, const float* x, const std::vector<float>& u,
                   const float* dy, int64_t T, std::vector<std::vector<float>>* grads, float* dx,
                   std::vector<float>& du) {
  const LoraMatrix* a = P.adapter(l, target);
  if (!a) return;
  const float s = P.lora->settings.scale();
  const int64_t r = a->rank;
  float* gA = grads ? (*grads)[P.lora->index[l][target]].data() : nullptr;
  float* gB = gA ? gA + r * a->in : nullptr;
  if (gB)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)a->out, (int)r, (int)T, 1.0f, dy, (int)a->out,
                u.data(), (int)r, 1.0f, gB, (int)r);
  du.resize(T * r);
  cpu::linear_backward_input(dy, a->b(), du.data(), T, r, a->out, false);
  for (float& v : du) v *= s;
  if (gA)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)a->in, (int)T, 1.0f, du.data(), (int)r, x,
                (int)a->in, 1.0f, gA, (int)a->in);
  cpu::linear_backward_input(du.data(), a->a(), dx, T, a->in, r, true);
}

// One layer forward from x_in to x_out (may alias), filling A.
void layer_forward(const Model& m, const Parts& P, int64_t l, int64_t T, const float* x_in, float* x_out,
                   LayerActs& A) {
  const FocusRouters& f = P.f;
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
  lora_forward(P, l, kLoraQ, A.xn1.data(), T, A.q.data(), A.lora_u[kLoraQ]);
  lora_forward(P, l, kLoraK, A.xn1.data(), T, A.k.data(), A.lora_u[kLoraK]);
  lora_forward(P, l, kLoraV, A.xn1.data(), T, A.v.data(), A.lora_u[kLoraV]);
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
  cpu::soft_attention_forward(A.q.data(), A.k.data(), A.v.data(), rp ? A.rc.p.data() : nullptr, A.att.data(),
                              A.lse.data(), attn_shape(c, f, l, T));

  // Attention projection and residual: h1 = x_in + post_norm(att Wo^T + bo).
  std::vector<float>& a = c.post_norms ? A.a_pre : A.h1;
  a.resize(T * D);
  cpu::linear(A.att.data(), L.wo, L.bo, a.data(), T, QD, D);
  lora_forward(P, l, kLoraO, A.att.data(), T, a.data(), A.lora_u[kLoraO]);
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
  std::vector<float> d1, dact, dgate, dup, dxn, dh1, datt, dq, dk, dv, dp, ds, tmp, du;
};

// Given dx = dL/dx_out [T, D] and layer l's input x_in and activations, replaces dx with
// dL/dx_in and accumulates the gradients of the router and adapters of the layer (those whose
// buffers are given).
void layer_backward(const Model& m, const Parts& P, const TrainableSet& ts, int64_t l, int64_t T, const float* x_in,
                    const LayerActs& A, float* dx, BackScratch& S) {
  const FocusRouters& f = P.f;
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
  lora_backward(P, l, kLoraO, A.att.data(), A.lora_u[kLoraO], da, T, ts.lora_grads, S.datt.data(), S.du);

  const RouterParams* rp = router_of(f, l);
  const int64_t G = f.settings.groups;
  S.dq.assign(T * QD, 0.f);
  S.dk.assign(T * KD, 0.f);
  S.dv.assign(T * KD, 0.f);
  if (rp) S.dp.assign(T * G, 0.f);
  cpu::soft_attention_backward(A.q.data(), A.k.data(), A.v.data(), rp ? A.rc.p.data() : nullptr, A.att.data(),
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
  lora_backward(P, l, kLoraQ, A.xn1.data(), A.lora_u[kLoraQ], S.dq.data(), T, ts.lora_grads, S.dxn.data(), S.du);
  lora_backward(P, l, kLoraK, A.xn1.data(), A.lora_u[kLoraK], S.dk.data(), T, ts.lora_grads, S.dxn.data(), S.du);
  lora_backward(P, l, kLoraV, A.xn1.data(), A.lora_u[kLoraV], S.dv.data(), T, ts.lora_grads, S.dxn.data(), S.du);
  if (rp) {
    const int64_t r = f.router_of_layer[l];
    S.ds.assign(T * G, 0.f);
    if (ts.router_hook) ts.router_hook(r, A.rc, S.ds.data());
    // Without router gradient buffers the router still passes its input gradient on.
    float* gr = nullptr;
    if (ts.router_grads) {
      gr = (*ts.router_grads)[r].data();
    } else {
      S.tmp.assign(rp->params.size(), 0.f);
      gr = S.tmp.data();
    }
    router_backward(*rp, A.xn1.data(), A.rc, S.dp.data(), S.ds.data(), gr, S.dxn.data());
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

void check_window(const Model& m, const TrainableSet& ts, const TrainWindow& w) {
  const ModelConfig& c = m.cfg;
  FOCUS_CHECK(w.T > 0 && w.ids && w.targets, "training window: empty");
  if (c.learned_pos)
    FOCUS_CHECK(w.T <= c.max_ctx, "training window of ", w.T, " tokens is longer than the model's ", c.max_ctx,
                " learned positions");
  if (ts.routers)
    FOCUS_CHECK((int64_t)ts.routers->router_of_layer.size() == c.layers, "routers: ",
                ts.routers->router_of_layer.size(), " layer entries for a model of ", c.layers, " layers");
  if (ts.lora) {
    FOCUS_CHECK((int64_t)ts.lora->index.size() == c.layers, "LoRA adapters: ", ts.lora->index.size(),
                " layer entries for a model of ", c.layers, " layers");
    for (const auto& a : ts.lora->mats)
      FOCUS_CHECK(a.in == lora_in_dim(c, a.target) && a.out == lora_out_dim(c, a.target) &&
                      (int64_t)a.params.size() == a.size(),
                  "LoRA adapter layers.", a.layer, ".", lora_target_name(a.target), " does not fit the model");
  }
  for (int64_t t = 0; t < w.T; ++t)
    FOCUS_CHECK(w.targets[t] < c.vocab, "training window: target id ", w.targets[t], " outside the vocabulary (",
                c.vocab, ")");
}

void check_grads(const std::vector<std::vector<float>>* grads, const std::vector<int64_t>& sizes, const char* what) {
  if (!grads) return;
  FOCUS_CHECK(grads->size() == sizes.size(), what, " gradients: ", grads->size(), " buffers for ", sizes.size(),
              " parameter blocks");
  for (size_t i = 0; i < sizes.size(); ++i)
    FOCUS_CHECK((int64_t)(*grads)[i].size() == sizes[i], what, " gradient ", i, " has the wrong size");
}

}  // namespace

LossGrad train_loss_and_grad(const Model& m, const TrainableSet& ts, const TrainWindow& w, float loss_scale,
                             const BackwardOptions& opt) {
  const ModelConfig& c = m.cfg;
  check_window(m, ts, w);
  static const FocusRouters no_routers;
  const Parts P{ts.routers ? *ts.routers : no_routers, ts.lora};
  const FocusRouters& f = P.f;
  const int64_t T = w.T, D = c.dim, NL = c.layers;
  if (ts.routers && ts.router_grads) {
    std::vector<int64_t> sizes;
    for (const auto& r : f.routers) sizes.push_back((int64_t)r.params.size());
    check_grads(ts.router_grads, sizes, "router");
  }
  int64_t lora_cols = 0;  // columns of the adapters' kept activations per layer
  if (ts.lora) {
    std::vector<int64_t> sizes;
    for (const auto& a : ts.lora->mats) sizes.push_back(a.size());
    check_grads(ts.lora_grads, sizes, "LoRA");
    lora_cols = ts.lora->settings.rank * (int64_t)ts.lora->settings.targets.size();
  }
  // Layers below the lowest trained part need no backward pass.
  int64_t first = NL;
  for (int64_t l = 0; l < NL; ++l)
    if ((ts.router_grads && router_of(f, l)) || (ts.lora_grads && P.adapted(l))) {
      first = l;
      break;
    }
  const bool need_grad = (ts.router_grads || ts.lora_grads) && first < NL;
  const bool recompute = opt.force_recompute >= 0 ? opt.force_recompute == 1
                                                  : layer_act_bytes(c, T, f.settings.groups, lora_cols) * (NL - first) >
                                                        opt.keep_activations_bytes;

  // Forward: xs[l] is layer l's input; xs[NL] the final residual.
  std::vector<std::vector<float>> xs(NL + 1);
  xs[0].resize(T * D);
  embed(m, w.ids, T, xs[0].data());
  std::vector<LayerActs> kept(need_grad && !recompute ? NL : 0);
  LayerActs scratch;
  for (int64_t l = 0; l < NL; ++l) {
    xs[l + 1].resize(T * D);
    LayerActs& A = (need_grad && !recompute && l >= first) ? kept[l] : scratch;
    layer_forward(m, P, l, T, xs[l].data(), xs[l + 1].data(), A);
    // Inputs of layers below the first trained one are not needed again.
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
      layer_forward(m, P, l, T, xs[l].data(), out.data(), scratch);
      A = &scratch;
    } else {
      A = &kept[l];
    }
    layer_backward(m, P, ts, l, T, xs[l].data(), *A, dx.data(), S);
    if (!recompute) kept[l] = LayerActs();
    std::vector<float>().swap(xs[l + 1]);
  }
  return res;
}

double train_loss(const Model& m, const TrainableSet& ts, const TrainWindow& w, int64_t* scored) {
  TrainableSet fwd;
  fwd.routers = ts.routers;
  fwd.lora = ts.lora;
  const LossGrad r = train_loss_and_grad(m, fwd, w, 1.0f);
  if (scored) *scored = r.scored;
  return r.loss_sum;
}

LossGrad focus_router_loss_and_grad(const Model& m, const FocusRouters& f, const TrainWindow& w, float loss_scale,
                                    std::vector<std::vector<float>>* grads, const RouterAuxHook& hook,
                                    const BackwardOptions& opt) {
  TrainableSet ts;
  ts.routers = &f;
  ts.router_grads = grads;
  ts.router_hook = hook;
  return train_loss_and_grad(m, ts, w, loss_scale, opt);
}

double focus_router_loss(const Model& m, const FocusRouters& f, const TrainWindow& w, int64_t* scored) {
  const LossGrad r = focus_router_loss_and_grad(m, f, w, 1.0f, nullptr);
  if (scored) *scored = r.scored;
  return r.loss_sum;
}

}  // namespace focus
