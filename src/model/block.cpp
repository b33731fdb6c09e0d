#include "model/block.h"

#include <cblas.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace focus {

void embed_tokens(const Model& m, const int32_t* ids, int64_t T, int64_t pos0, float* x) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim;
  if (c.learned_pos)
    FOCUS_CHECK(pos0 + T <= c.max_ctx, "position ", pos0 + T - 1, " is beyond the model's ", c.max_ctx,
                " learned positions");
  for (int64_t t = 0; t < T; ++t) {
    FOCUS_CHECK(ids[t] >= 0 && ids[t] < c.vocab, "token id ", ids[t], " outside the vocabulary (", c.vocab, ")");
    float* e = x + t * D;
    dequantize_rows(m.w.tok_emb, ids[t], 1, e);
    for (int64_t i = 0; i < D; ++i) e[i] *= c.embed_scale;
    if (c.learned_pos) {
      const float* p = m.w.pos_emb + (pos0 + t) * D;
      for (int64_t i = 0; i < D; ++i) x[t * D + i] += p[i];
    }
  }
}

void model_norm(const ModelConfig& c, const float* x, const float* w, const float* b, float* out, int64_t rows) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm(x, w, out, rows, c.dim, c.norm_eps);
  else
    cpu::layernorm(x, w, b, out, rows, c.dim, c.norm_eps);
}

void model_norm_backward(const ModelConfig& c, const float* x, const float* w, const float* dy, float* dx,
                         int64_t rows, bool accumulate) {
  if (c.norm == NormKind::RMS)
    cpu::rmsnorm_backward(x, w, dy, dx, rows, c.dim, c.norm_eps, accumulate);
  else
    cpu::layernorm_backward(x, w, dy, dx, rows, c.dim, c.norm_eps, accumulate);
}

namespace {

float rope_theta(const ModelConfig& c, int64_t layer) {
  return c.layer_sliding_window[layer] > 0 ? c.rope_theta_local : c.rope_theta;
}

// The layer's attention call over what block_run left in A (training: k and v in A).
AttentionCall train_call(const Model& m, int64_t layer, int64_t T, BlockActs& A) {
  AttentionCall call;
  call.cfg = &m.cfg;
  call.layer = layer;
  call.T = T;
  call.xn = A.xn1.data();
  call.q = A.q.data();
  call.k = A.k.data();
  call.v = A.v.data();
  call.out = A.att.data();
  return call;
}

// ---- Multi-head latent attention (config.h), absorbed. Sizes: H heads, N / R query-key dims
// without / with RoPE, C latent dims, V value dims; the attention's head_dim is R + C. Head h's
// key up-projection W_uk is rows [h (N + V), h (N + V) + N) of w_kv_b ([N, C]), its value
// up-projection W_uv the next V rows ([V, C]).
struct MlaDims {
  int64_t D, H, N, R, C, V, HD, QH, QR;
  explicit MlaDims(const ModelConfig& c)
      : D(c.dim), H(c.heads), N(c.mla_nope), R(c.mla_rope), C(c.mla_kv_rank), V(c.mla_v), HD(c.head_dim),
        QH(c.mla_nope + c.mla_rope), QR(c.mla_q_rank) {}
  const float* w_uk(const float* kvb, int64_t h) const { return kvb + h * (N + V) * C; }
  const float* w_uv(const float* kvb, int64_t h) const { return kvb + (h * (N + V) + N) * C; }
};

const float* mla_kv_b(const LayerWeights& L) {
  FOCUS_CHECK(L.w_kv_b.is_f32(), "MLA: the key/value up-projection must be float32");
  return L.w_kv_b.f32_data();
}

// q [T, H HD] = per head [q_pe | q_nope W_uk], k [T, HD] = [k_pe | norm(latent)] (RoPE comes
// after, on the first R dims of each row, as for any model); v gets k's rows (it may be k). With a
// q rank the query projection reads norm(xn W_qa^T) instead of xn.
void mla_project(const ModelConfig& c, const LayerWeights& L, const float* xn, int64_t T, BlockActs& A, float* q,
                 float* k, float* v) {
  const MlaDims d(c);
  A.q_raw.resize(T * d.H * d.QH);
  A.kv_a.resize(T * (d.C + d.R));
  A.c_pre.resize(T * d.C);
  if (d.QR > 0) {
    A.q_a_pre.resize(T * d.QR);
    A.q_a.resize(T * d.QR);
    cpu::linear(xn, L.wq_a, nullptr, A.q_a_pre.data(), T, d.D, d.QR);
    cpu::rmsnorm(A.q_a_pre.data(), L.q_a_norm, A.q_a.data(), T, d.QR, c.norm_eps);
    cpu::linear(A.q_a.data(), L.wq, nullptr, A.q_raw.data(), T, d.QR, d.H * d.QH);
  } else {
    cpu::linear(xn, L.wq, nullptr, A.q_raw.data(), T, d.D, d.H * d.QH);
  }
  cpu::linear(xn, L.wk, nullptr, A.kv_a.data(), T, d.D, d.C + d.R);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(A.c_pre.data() + t * d.C, A.kv_a.data() + t * (d.C + d.R), d.C * sizeof(float));
  A.c_norm.resize(T * d.C);
  float* cn = A.c_norm.data();
  cpu::rmsnorm(A.c_pre.data(), L.kv_a_norm, cn, T, d.C, c.norm_eps);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(k + t * d.HD, A.kv_a.data() + t * (d.C + d.R) + d.C, d.R * sizeof(float));
    std::memcpy(k + t * d.HD + d.R, cn + t * d.C, d.C * sizeof(float));
  }
  const float* kvb = mla_kv_b(L);
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(q + t * d.H * d.HD + h * d.HD, A.q_raw.data() + t * d.H * d.QH + h * d.QH + d.N, d.R * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)d.C, (int)d.N, 1.f,
                A.q_raw.data() + h * d.QH, (int)(d.H * d.QH), d.w_uk(kvb, h), (int)d.C, 0.f, q + h * d.HD + d.R,
                (int)(d.H * d.HD));
  }
  if (v != k) std::memcpy(v, k, T * d.HD * sizeof(float));
}

// att_v [T, H V] = per head (the latent part of the attention output) W_uv^T.
void mla_values(const ModelConfig& c, const LayerWeights& L, const float* att, int64_t T, float* att_v) {
  const MlaDims d(c);
  const float* kvb = mla_kv_b(L);
  for (int64_t h = 0; h < d.H; ++h)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)d.V, (int)d.C, 1.f, att + h * d.HD + d.R,
                (int)(d.H * d.HD), d.w_uv(kvb, h), (int)d.C, 0.f, att_v + h * d.V, (int)(d.H * d.V));
}

// Given datt_v: datt [T, H HD] (zero on the RoPE dims, which no value reads) and dW_uv.
void mla_values_backward(const ModelConfig& c, const LayerWeights& L, const float* att, const float* datt_v, int64_t T,
                         float* datt, float* g_kv_b) {
  const MlaDims d(c);
  const float* kvb = mla_kv_b(L);
  std::fill(datt, datt + T * d.H * d.HD, 0.f);
  for (int64_t h = 0; h < d.H; ++h) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)T, (int)d.C, (int)d.V, 1.f, datt_v + h * d.V,
                (int)(d.H * d.V), d.w_uv(kvb, h), (int)d.C, 0.f, datt + h * d.HD + d.R, (int)(d.H * d.HD));
    if (g_kv_b)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d.V, (int)d.C, (int)T, 1.f, datt_v + h * d.V,
                  (int)(d.H * d.V), att + h * d.HD + d.R, (int)(d.H * d.HD), 1.f,
                  g_kv_b + (h * (d.N + d.V) + d.N) * d.C, (int)d.C);
  }
}

// Given dq [T, H HD] and dk [T, HD] (after RoPE's backward): dxn (overwritten) and the gradients
// of the query projection(s) and query norm, the latent projection, its norm and W_uk.
void mla_project_backward(const ModelConfig& c, const LayerWeights& L, const float* xn, const BlockActs& A,
                          const float* dq, const float* dk, int64_t T, BlockGradScratch& S, float* dxn,
                          const LayerGrads& G) {
  const MlaDims d(c);
  const float* kvb = mla_kv_b(L);
  S.dq_raw.assign(T * d.H * d.QH, 0.f);
  for (int64_t h = 0; h < d.H; ++h) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(S.dq_raw.data() + t * d.H * d.QH + h * d.QH + d.N, dq + t * d.H * d.HD + h * d.HD, d.R * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)T, (int)d.N, (int)d.C, 1.f, dq + h * d.HD + d.R,
                (int)(d.H * d.HD), d.w_uk(kvb, h), (int)d.C, 0.f, S.dq_raw.data() + h * d.QH, (int)(d.H * d.QH));
    if (G.w_kv_b)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)d.N, (int)d.C, (int)T, 1.f, A.q_raw.data() + h * d.QH,
                  (int)(d.H * d.QH), dq + h * d.HD + d.R, (int)(d.H * d.HD), 1.f, G.w_kv_b + h * (d.N + d.V) * d.C,
                  (int)d.C);
  }
  S.dkv_a.resize(T * (d.C + d.R));
  S.dc_norm.resize(T * d.C);
  S.dc.resize(T * d.C);
  float *dcn = S.dc_norm.data(), *dc = S.dc.data();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(S.dkv_a.data() + t * (d.C + d.R) + d.C, dk + t * d.HD, d.R * sizeof(float));
    std::memcpy(dcn + t * d.C, dk + t * d.HD + d.R, d.C * sizeof(float));
  }
  if (G.kv_a_norm) cpu::rmsnorm_backward_weight(A.c_pre.data(), dcn, G.kv_a_norm, T, d.C, c.norm_eps);
  cpu::rmsnorm_backward(A.c_pre.data(), L.kv_a_norm, dcn, dc, T, d.C, c.norm_eps, false);
  for (int64_t t = 0; t < T; ++t)
    std::memcpy(S.dkv_a.data() + t * (d.C + d.R), dc + t * d.C, d.C * sizeof(float));
  if (d.QR > 0) {
    S.dq_a_norm.resize(T * d.QR);
    S.dq_a.resize(T * d.QR);
    if (G.wq) cpu::linear_backward_weight(S.dq_raw.data(), A.q_a.data(), G.wq, nullptr, T, d.QR, d.H * d.QH);
    cpu::linear_backward_input(S.dq_raw.data(), L.wq, S.dq_a_norm.data(), T, d.QR, d.H * d.QH, false);
    if (G.q_a_norm)
      cpu::rmsnorm_backward_weight(A.q_a_pre.data(), S.dq_a_norm.data(), G.q_a_norm, T, d.QR, c.norm_eps);
    cpu::rmsnorm_backward(A.q_a_pre.data(), L.q_a_norm, S.dq_a_norm.data(), S.dq_a.data(), T, d.QR, c.norm_eps,
                          false);
    if (G.wq_a) cpu::linear_backward_weight(S.dq_a.data(), xn, G.wq_a, nullptr, T, d.D, d.QR);
    cpu::linear_backward_input(S.dq_a.data(), L.wq_a, dxn, T, d.D, d.QR, false);
  } else {
    if (G.wq) cpu::linear_backward_weight(S.dq_raw.data(), xn, G.wq, nullptr, T, d.D, d.H * d.QH);
    cpu::linear_backward_input(S.dq_raw.data(), L.wq, dxn, T, d.D, d.H * d.QH, false);
  }
  if (G.wk) cpu::linear_backward_weight(S.dkv_a.data(), xn, G.wk, nullptr, T, d.D, d.C + d.R);
  cpu::linear_backward_input(S.dkv_a.data(), L.wk, dxn, T, d.D, d.C + d.R, true);
}

// The block, for inference (train false: attention through policy.attend, keys and values into
// the cache rows of io, activations overwritten in place where the backward pass would need them)
// and for training (train true: policy.train_forward, every activation kept in A).
void block_run(const Model& m, const AttentionPolicy& policy, const BlockIO& io, BlockActs& A, bool train,
               const ProjectionAdapter* adapter, std::unique_ptr<AttentionState>* state, AttentionStats* stats) {
  const ModelConfig& c = m.cfg;
  const int64_t l = io.layer, T = io.T, D = c.dim, QD = c.q_dim(), KD = c.kv_dim(), F = c.ffn;
  const LayerWeights& L = m.w.layers[l];
  auto adapt = [&](int proj, const float* x, float* y) {
    if (adapter && adapter->adapts(l, proj)) adapter->forward(l, proj, x, T, y, A.adapter_keep[proj]);
  };
  A.xn1.resize(T * D);
  A.q.resize(T * QD);
  A.att.resize(T * QD);
  A.h1.resize(T * D);
  A.xn2.resize(T * D);
  // Where the new keys and values are computed: in place in a float cache, else in A.
  const bool float_cache = !train && io.kv_type == cpu::KvType::F32 && io.k_cache;
  float *k, *v;
  if (float_cache) {
    k = static_cast<float*>(io.k_cache) + io.pos0 * KD;
    v = static_cast<float*>(io.v_cache) + io.pos0 * KD;
  } else {
    A.k.resize(T * KD);
    A.v.resize(T * KD);
    k = A.k.data();
    v = A.v.data();
  }

  // Attention block.
  model_norm(c, io.x_in, L.attn_norm, L.attn_norm_b, A.xn1.data(), T);
  if (c.mla()) {
    mla_project(c, L, A.xn1.data(), T, A, A.q.data(), k, v);
  } else {
    const cpu::LinearOut qkv[3] = {{&L.wq, L.bq, A.q.data()}, {&L.wk, L.bk, k}, {&L.wv, L.bv, v}};
    cpu::linear_multi(A.xn1.data(), qkv, 3, T, D);
    adapt(kProjQ, A.xn1.data(), A.q.data());
    adapt(kProjK, A.xn1.data(), k);
    adapt(kProjV, A.xn1.data(), v);
  }
  if (c.qk_norm) {
    const float* q_in = A.q.data();
    const float* k_in = k;
    if (train) {
      A.q_pre = A.q;
      A.k_pre = A.k;
      q_in = A.q_pre.data();
      k_in = A.k_pre.data();
    }
    cpu::rmsnorm(q_in, L.q_norm, A.q.data(), T * c.heads, c.head_dim, c.norm_eps);
    cpu::rmsnorm(k_in, L.k_norm, k, T * c.kv_heads, c.head_dim, c.norm_eps);
  }
  if (c.rope_dim > 0) {
    cpu::rope(A.q.data(), T, c.heads, c.head_dim, c.rope_dim, io.pos0, rope_theta(c, l), c.rope_style);
    cpu::rope(k, T, c.kv_heads, c.head_dim, c.rope_dim, io.pos0, rope_theta(c, l), c.rope_style);
  }
  if (train) {
    policy.train_forward(train_call(m, l, T, A), A.tape);
  } else {
    AttentionCall call;
    call.cfg = &c;
    call.layer = l;
    call.pos0 = io.pos0;
    call.T = T;
    call.xn = A.xn1.data();
    call.q = A.q.data();
    call.out = A.att.data();
    call.k_new = k;  // the new keys (rounded to the cache's type below when it is 16-bit)
    call.cache_k = cpu::KvView(io.k_cache, io.kv_type);
    call.cache_v = cpu::KvView(io.v_cache, io.kv_type);
    if (float_cache) {
      call.k = static_cast<const float*>(io.k_cache);
      call.v = static_cast<const float*>(io.v_cache);
    } else {
      // The new rows as the cache will hold them, stored; attention sees only stored values.
      const int64_t bytes = cpu::kv_type_bytes(io.kv_type);
      cpu::kv_round(k, T * KD, io.kv_type);
      cpu::kv_round(v, T * KD, io.kv_type);
      if (io.k_cache) {  // (a cache that keeps no rows: the window's attention reads k, v below)
        cpu::kv_store(k, T * KD, io.kv_type, static_cast<char*>(io.k_cache) + io.pos0 * KD * bytes);
        cpu::kv_store(v, T * KD, io.kv_type, static_cast<char*>(io.v_cache) + io.pos0 * KD * bytes);
      }
      if (io.pos0 == 0) {  // the new rows are the whole sequence
        call.k = k;
        call.v = v;
      } else if (!policy.reads_cache_views()) {
        const int64_t n = (io.pos0 + T) * KD;
        A.k_all.resize(n);
        A.v_all.resize(n);
        cpu::kv_load_floats(call.cache_k, n, A.k_all.data());
        cpu::kv_load_floats(call.cache_v, n, A.v_all.data());
        call.k = A.k_all.data();
        call.v = A.v_all.data();
      }
    }
    policy.attend(call, *state, stats);
  }

  // Projection and residual: h1 = x_in + post_norm(att Wo^T + bo).
  float* a = A.h1.data();
  if (c.post_norms) {
    A.a_pre.resize(T * D);
    a = A.a_pre.data();
  }
  const float* att = A.att.data();
  if (c.mla()) {
    A.att_v.resize(T * c.o_proj_dim());
    mla_values(c, L, A.att.data(), T, A.att_v.data());
    att = A.att_v.data();
  }
  cpu::linear(att, L.wo, L.bo, a, T, c.o_proj_dim(), D);
  adapt(kProjO, att, a);
  if (c.post_norms) cpu::rmsnorm(A.a_pre.data(), L.post_attn_norm, A.h1.data(), T, D, c.norm_eps);
  cpu::add_inplace(A.h1.data(), io.x_in, T * D);

  // MLP block: x_out = h1 + post_norm(mlp(norm(h1))).
  model_norm(c, A.h1.data(), L.ffn_norm, L.ffn_norm_b, A.xn2.data(), T);
  A.up.resize(T * F);
  float* act = nullptr;
  if (c.mlp == MlpKind::GELU) {
    cpu::linear(A.xn2.data(), L.w_up, L.b_up, A.up.data(), T, D, F);
    act = A.up.data();
    if (train) {
      A.act = A.up;
      act = A.act.data();
    }
    cpu::gelu_tanh(act, T * F);
  } else {
    A.gate.resize(T * F);
    const cpu::LinearOut gate_up[2] = {{&L.w_gate, nullptr, A.gate.data()}, {&L.w_up, L.b_up, A.up.data()}};
    cpu::linear_multi(A.xn2.data(), gate_up, 2, T, D);
    act = A.gate.data();
    if (train) {
      A.act = A.gate;
      act = A.act.data();
    }
    if (c.mlp == MlpKind::SwiGLU)
      cpu::silu_mul(act, A.up.data(), T * F);
    else
      cpu::gelu_tanh_mul(act, A.up.data(), T * F);
  }
  if (c.post_norms) {
    A.m_pre.resize(T * D);
    cpu::linear(act, L.w_down, L.b_down, A.m_pre.data(), T, F, D);
    cpu::rmsnorm(A.m_pre.data(), L.post_ffn_norm, io.x_out, T, D, c.norm_eps);
  } else {
    cpu::linear(act, L.w_down, L.b_down, io.x_out, T, F, D);
  }
  cpu::add_inplace(io.x_out, A.h1.data(), T * D);
}

// The gradient before a post norm (Gemma 3) given dy after it: in buf, or dy itself without one.
const float* post_norm_backward(const ModelConfig& c, const std::vector<float>& pre, const float* w,
                                const float* dy, int64_t T, std::vector<float>& buf, float* dw) {
  if (!c.post_norms) return dy;
  if (dw) cpu::rmsnorm_backward_weight(pre.data(), dy, dw, T, c.dim, c.norm_eps);
  buf.resize(T * c.dim);
  cpu::rmsnorm_backward(pre.data(), w, dy, buf.data(), T, c.dim, c.norm_eps, false);
  return buf.data();
}

}  // namespace

void block_forward(const Model& m, const AttentionPolicy& policy, const BlockIO& io, BlockActs& A,
                   std::unique_ptr<AttentionState>& state, AttentionStats* stats) {
  FOCUS_CHECK((io.k_cache && io.v_cache) || io.pos0 == 0, "block_forward: no KV cache rows given");
  block_run(m, policy, io, A, false, nullptr, &state, stats);
}

void block_train_forward(const Model& m, const AttentionPolicy& policy, const BlockIO& io, BlockActs& A,
                         const ProjectionAdapter* adapter) {
  FOCUS_CHECK(io.pos0 == 0, "block_train_forward: a training window starts at position 0");
  block_run(m, policy, io, A, true, adapter, nullptr, nullptr);
}

void block_backward(const Model& m, const AttentionPolicy& policy, int64_t l, int64_t T, const float* x_in,
                    BlockActs& A, const ProjectionAdapter* adapter, float* dx, BlockGradScratch& S,
                    const LayerGrads* g) {
  const ModelConfig& c = m.cfg;
  const LayerWeights& L = m.w.layers[l];
  const int64_t D = c.dim, QD = c.q_dim(), KD = c.kv_dim(), F = c.ffn;
  auto adapt_back = [&](int proj, const float* x, const float* dy, float* dxin) {
    if (adapter && adapter->adapts(l, proj)) adapter->backward(l, proj, x, A.adapter_keep[proj], dy, T, dxin);
  };
  static const LayerGrads kNone;
  const LayerGrads& G = g ? *g : kNone;
  // dW += dy^T x (and db += colsum dy) of a projection y[T, N] = x[T, K] W^T + b, when trained.
  auto weight_back = [&](const float* dy, const float* x, float* dW, float* db, int64_t K, int64_t N) {
    if (dW) cpu::linear_backward_weight(dy, x, dW, db, T, K, N);
    else if (db) FOCUS_CHECK(false, "block_backward: a bias gradient without its matrix's");
  };
  // The weight (and bias) gradient of the model's norm over rows of width D.
  auto norm_back = [&](const float* x, const float* dy, float* dw, float* db) {
    if (!dw) return;
    if (c.norm == NormKind::RMS) cpu::rmsnorm_backward_weight(x, dy, dw, T, D, c.norm_eps);
    else cpu::layernorm_backward_weight(x, dy, dw, db, T, D, c.norm_eps);
  };

  // MLP block: x_out = h1 + post(down(act)).
  const float* dm = post_norm_backward(c, A.m_pre, L.post_ffn_norm, dx, T, S.d1, G.post_ffn_norm);
  weight_back(dm, A.act.data(), G.w_down, G.b_down, F, D);
  S.dact.resize(T * F);
  cpu::linear_backward_input(dm, L.w_down, S.dact.data(), T, F, D, false);
  S.dup.resize(T * F);
  S.dxn.resize(T * D);
  if (c.mlp == MlpKind::GELU) {
    cpu::gelu_tanh_backward(A.up.data(), S.dact.data(), S.dup.data(), T * F);
    weight_back(S.dup.data(), A.xn2.data(), G.w_up, G.b_up, D, F);
    cpu::linear_backward_input(S.dup.data(), L.w_up, S.dxn.data(), T, D, F, false);
  } else {
    S.dgate.resize(T * F);
    if (c.mlp == MlpKind::SwiGLU)
      cpu::silu_mul_backward(A.gate.data(), A.up.data(), S.dact.data(), S.dgate.data(), S.dup.data(), T * F);
    else
      cpu::gelu_tanh_mul_backward(A.gate.data(), A.up.data(), S.dact.data(), S.dgate.data(), S.dup.data(), T * F);
    weight_back(S.dgate.data(), A.xn2.data(), G.w_gate, nullptr, D, F);
    weight_back(S.dup.data(), A.xn2.data(), G.w_up, G.b_up, D, F);
    cpu::linear_backward_input(S.dgate.data(), L.w_gate, S.dxn.data(), T, D, F, false);
    cpu::linear_backward_input(S.dup.data(), L.w_up, S.dxn.data(), T, D, F, true);
  }
  // dh1 = dx + norm'(h1) dxn  (kept in dx)
  norm_back(A.h1.data(), S.dxn.data(), G.ffn_norm, G.ffn_norm_b);
  model_norm_backward(c, A.h1.data(), L.ffn_norm, S.dxn.data(), dx, T, true);

  // Attention block: h1 = x_in + post(att Wo^T).
  const float* da = post_norm_backward(c, A.a_pre, L.post_attn_norm, dx, T, S.d1, G.post_attn_norm);
  S.datt.resize(T * QD);
  if (c.mla()) {
    const int64_t OW = c.o_proj_dim();
    weight_back(da, A.att_v.data(), G.wo, G.bo, OW, D);
    S.datt_v.resize(T * OW);
    cpu::linear_backward_input(da, L.wo, S.datt_v.data(), T, OW, D, false);
    mla_values_backward(c, L, A.att.data(), S.datt_v.data(), T, S.datt.data(), G.w_kv_b);
  } else {
    weight_back(da, A.att.data(), G.wo, G.bo, QD, D);
    cpu::linear_backward_input(da, L.wo, S.datt.data(), T, QD, D, false);
    adapt_back(kProjO, A.att.data(), da, S.datt.data());
  }

  const AttentionCall call = train_call(m, l, T, A);
  S.dq.assign(T * QD, 0.f);
  S.dk.assign(T * KD, 0.f);
  S.dv.assign(T * KD, 0.f);
  policy.train_backward(call, A.tape, S.datt.data(), S.dq.data(), S.dk.data(), S.dv.data());
  if (c.shared_kv())  // the values were the keys' rows
    for (int64_t i = 0; i < T * KD; ++i) S.dk[i] += S.dv[i];
  if (c.rope_dim > 0) {
    cpu::rope_backward(S.dq.data(), T, c.heads, c.head_dim, c.rope_dim, 0, rope_theta(c, l), c.rope_style);
    cpu::rope_backward(S.dk.data(), T, c.kv_heads, c.head_dim, c.rope_dim, 0, rope_theta(c, l), c.rope_style);
  }
  if (c.qk_norm) {
    if (G.q_norm) cpu::rmsnorm_backward_weight(A.q_pre.data(), S.dq.data(), G.q_norm, T * c.heads, c.head_dim, c.norm_eps);
    if (G.k_norm)
      cpu::rmsnorm_backward_weight(A.k_pre.data(), S.dk.data(), G.k_norm, T * c.kv_heads, c.head_dim, c.norm_eps);
    cpu::rmsnorm_backward(A.q_pre.data(), L.q_norm, S.dq.data(), S.dq.data(), T * c.heads, c.head_dim, c.norm_eps,
                          false);
    cpu::rmsnorm_backward(A.k_pre.data(), L.k_norm, S.dk.data(), S.dk.data(), T * c.kv_heads, c.head_dim,
                          c.norm_eps, false);
  }
  S.dxn.resize(T * D);
  if (c.mla()) {
    mla_project_backward(c, L, A.xn1.data(), A, S.dq.data(), S.dk.data(), T, S, S.dxn.data(), G);
  } else {
    weight_back(S.dq.data(), A.xn1.data(), G.wq, G.bq, D, QD);
    weight_back(S.dk.data(), A.xn1.data(), G.wk, G.bk, D, KD);
    weight_back(S.dv.data(), A.xn1.data(), G.wv, G.bv, D, KD);
    cpu::linear_backward_input(S.dq.data(), L.wq, S.dxn.data(), T, D, QD, false);
    cpu::linear_backward_input(S.dk.data(), L.wk, S.dxn.data(), T, D, KD, true);
    cpu::linear_backward_input(S.dv.data(), L.wv, S.dxn.data(), T, D, KD, true);
    adapt_back(kProjQ, A.xn1.data(), S.dq.data(), S.dxn.data());
    adapt_back(kProjK, A.xn1.data(), S.dk.data(), S.dxn.data());
    adapt_back(kProjV, A.xn1.data(), S.dv.data(), S.dxn.data());
  }
  policy.train_backward_input(call, A.tape, S.dxn.data());
  // dx_in = dh1 + norm'(x_in) dxn1
  norm_back(x_in, S.dxn.data(), G.attn_norm, G.attn_norm_b);
  model_norm_backward(c, x_in, L.attn_norm, S.dxn.data(), dx, T, true);
}

}  // namespace focus
