#include "train/backward.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "focus/focus_attention.h"
#include "kernels/cpu/ops.h"
#include "model/block.h"

namespace focus {
namespace {

// Bytes of one layer's activations (for the keep-or-recompute decision).
double layer_act_bytes(const ModelConfig& c, int64_t T, int64_t G, int64_t lora_cols) {
  double f = (double)T * (c.dim * 4 + c.q_dim() * 2 + c.kv_dim() * 2 + c.ffn * 3 + c.heads + G * 2 + lora_cols);
  if (c.qk_norm) f += (double)T * (c.q_dim() + c.kv_dim());
  if (c.post_norms) f += (double)T * c.dim * 2;
  return 4 * f;
}

}  // namespace

MemoryNeed training_memory(const ModelConfig& c, int64_t T, int64_t G, int64_t lora_cols, const BackwardOptions& opt) {
  const double layer = layer_act_bytes(c, T, G, lora_cols), all = layer * (double)c.layers;
  const bool recompute = opt.force_recompute >= 0 ? opt.force_recompute == 1 : all > opt.keep_activations_bytes;
  MemoryNeed need;
  need.add("layer inputs", 4.0 * (double)(c.layers + 1) * (double)T * (double)c.dim);
  need.add(recompute ? "one layer's activations (recomputed)" : "kept activations", recompute ? 2 * layer : all);
  need.add("logits and gradients", 4.0 * (double)T * (double)c.dim * 2 + 16.0 * (1 << 20) * 4);
  need.add("routing", 4.0 * 12 * (double)T * (double)G * (double)std::max<int64_t>(c.kv_heads, 1));
  return need;
}

namespace {

// LoRA adapters run unmerged on the block's projections: y += (alpha / r) (x A^T) B^T. keep holds
// the scaled u = (alpha / r) x A^T [T, r] for the backward pass.
class LoraProjections final : public ProjectionAdapter {
 public:
  LoraProjections(const LoraAdapters& a, std::vector<std::vector<float>>* grads) : a_(a), grads_(grads) {}

  bool adapts(int64_t layer, int proj) const override { return a_.find(layer, proj) != nullptr; }

  void forward(int64_t layer, int proj, const float* x, int64_t T, float* y, std::vector<float>& u) const override {
    const LoraMatrix* a = a_.find(layer, proj);
    const float s = a_.settings.scale();
    u.resize(T * a->rank);
    cpu::linear(x, a->a(), nullptr, u.data(), T, a->in, a->rank);
    for (float& v : u) v *= s;
    cpu::linear_acc(u.data(), a->b(), y, T, a->rank, a->out);
  }

  // Given dy = dL/dy [T, out]: adds the adapter's part of dL/dx into dx and, when the adapters are
  // trained, accumulates dL/dA and dL/dB into the adapter's gradient (laid out like its params).
  //   dB += dy^T u      du = (alpha / r) dy B      dA += du^T x      dx += du A
  void backward(int64_t layer, int proj, const float* x, const std::vector<float>& u, const float* dy, int64_t T,
                float* dx) const override {
    const LoraMatrix* a = a_.find(layer, proj);
    const float s = a_.settings.scale();
    const int64_t r = a->rank;
    float* gA = grads_ ? (*grads_)[a_.index[layer][proj]].data() : nullptr;
    float* gB = gA ? gA + r * a->in : nullptr;
    if (gB)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)a->out, (int)r, (int)T, 1.0f, dy, (int)a->out,
                  u.data(), (int)r, 1.0f, gB, (int)r);
    du_.resize(T * r);
    cpu::linear_backward_input(dy, a->b(), du_.data(), T, r, a->out, false);
    for (float& v : du_) v *= s;
    if (gA)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)r, (int)a->in, (int)T, 1.0f, du_.data(), (int)r, x,
                  (int)a->in, 1.0f, gA, (int)a->in);
    cpu::linear_backward_input(du_.data(), a->a(), dx, T, a->in, r, true);
  }

 private:
  const LoraAdapters& a_;
  std::vector<std::vector<float>>* grads_;
  mutable std::vector<float> du_;
};

// Cross-entropy head over the final residual x [T, D]: returns the NLL sum; when dx is not null,
// writes dL/dx (L = loss_scale * NLL sum). Logits are made in row chunks (no [T, vocab] buffer).
double head_loss(const Model& m, const float* x, const TrainWindow& w, float loss_scale, float* dx, int64_t* scored,
                 const ModelGrads* mg) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim, V = c.vocab, T = w.T;
  std::vector<float> h(T * D);
  model_norm(c, x, m.w.out_norm, m.w.out_norm_b, h.data(), T);
  const int64_t chunk = std::clamp<int64_t>((int64_t)(16 << 20) / std::max<int64_t>(V, 1), 8, 256);
  std::vector<float> logits(chunk * V);
  std::vector<float> dh(dx ? T * D : 0);
  double nll = 0;
  int64_t n = 0;
  // Each row's NLL, summed in row order after the parallel loop (an OpenMP reduction adds the
  // threads' partial sums in the order they arrive, so the last bits would change from run to run).
  std::vector<double> row_nll(chunk);
  for (int64_t r0 = 0; r0 < T; r0 += chunk) {
    const int64_t rows = std::min(chunk, T - r0);
    cpu::linear(h.data() + r0 * D, m.w.lm_head, nullptr, logits.data(), rows, D, V);
#pragma omp parallel for schedule(static)
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
      row_nll[r] = lse - lr[tgt];
      if (dx) {
        for (int64_t i = 0; i < V; ++i) lr[i] = (float)(std::exp((double)lr[i] - lse) * loss_scale);
        lr[tgt] -= loss_scale;
      }
    }
    double part = 0;
    for (int64_t r = 0; r < rows; ++r)
      if (w.targets[r0 + r] >= 0) {
        part += row_nll[r];
        ++n;
      }
    nll += part;
    if (dx) cpu::linear_backward_input(logits.data(), m.w.lm_head, dh.data() + r0 * D, rows, D, V, false);
    if (dx && mg) cpu::linear_backward_weight(logits.data(), h.data() + r0 * D, mg->lm_head, nullptr, rows, D, V);
  }
  if (dx && mg) {
    if (c.norm == NormKind::RMS) cpu::rmsnorm_backward_weight(x, dh.data(), mg->out_norm, T, D, c.norm_eps);
    else cpu::layernorm_backward_weight(x, dh.data(), mg->out_norm, mg->out_norm_b, T, D, c.norm_eps);
  }
  if (dx) model_norm_backward(c, x, m.w.out_norm, dh.data(), dx, T, false);
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

// Training the model's own weights needs them as float32 and a gradient for every one.
void check_model_grads(const Model& m, const ModelGrads& g) {
  const ModelConfig& c = m.cfg;
  FOCUS_CHECK((int64_t)g.layers.size() == c.layers, "model gradients: ", g.layers.size(), " layers for a model of ",
              c.layers);
  FOCUS_CHECK(g.tok_emb && g.lm_head && g.out_norm && (!c.learned_pos || g.pos_emb),
              "model gradients: the embedding, output norm and output head need gradient buffers");
  FOCUS_CHECK(m.w.tok_emb.is_f32() && m.w.lm_head.is_f32(), "training the model's weights needs them as float32");
  for (int64_t l = 0; l < c.layers; ++l) {
    const LayerWeights& L = m.w.layers[l];
    for (const Weight* W : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down, &L.wq_a})
      FOCUS_CHECK(!*W || W->is_f32(), "training the model's weights needs them as float32 (layer ", l, ")");
  }
}

// Embedding backward: dE[ids[t]] += embed_scale dx0[t], dP[t] += dx0[t].
void embed_backward(const Model& m, const int32_t* ids, int64_t T, const float* dx0, const ModelGrads& g) {
  const ModelConfig& c = m.cfg;
  const int64_t D = c.dim;
  for (int64_t t = 0; t < T; ++t) {
    float* e = g.tok_emb + (int64_t)ids[t] * D;
    for (int64_t i = 0; i < D; ++i) e[i] += c.embed_scale * dx0[t * D + i];
    if (c.learned_pos)
      for (int64_t i = 0; i < D; ++i) g.pos_emb[t * D + i] += dx0[t * D + i];
  }
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
  const int64_t T = w.T, D = c.dim, NL = c.layers;
  if (ts.routers && ts.router_grads) {
    std::vector<int64_t> sizes;
    for (const auto& r : ts.routers->routers) sizes.push_back((int64_t)r.params.size());
    check_grads(ts.router_grads, sizes, "router");
  }
  int64_t lora_cols = 0;  // columns of the adapters' kept activations per layer
  std::unique_ptr<LoraProjections> adapter;
  if (ts.lora) {
    std::vector<int64_t> sizes;
    for (const auto& a : ts.lora->mats) sizes.push_back(a.size());
    check_grads(ts.lora_grads, sizes, "LoRA");
    lora_cols = ts.lora->settings.rank * (int64_t)ts.lora->settings.targets.size();
    adapter = std::make_unique<LoraProjections>(*ts.lora, ts.lora_grads);
  }
  const AttentionPlan plan =
      ts.routers ? focus_train_plan(c, *ts.routers, ts.router_grads, ts.router_hook, ts.router_detach_input) : AttentionPlan{};
  auto adapted = [&](int64_t l) {
    for (int p = 0; p < kProjections; ++p)
      if (adapter && adapter->adapts(l, p)) return true;
    return false;
  };
  if (ts.model_grads) check_model_grads(m, *ts.model_grads);
  // Layers below the lowest trained part need no backward pass.
  int64_t first = ts.model_grads ? 0 : NL;
  for (int64_t l = 0; l < first; ++l)
    if (plan.at(l).trains_parameters() || (ts.lora_grads && adapted(l))) {
      first = l;
      break;
    }
  const bool need_grad = (ts.router_grads || ts.lora_grads || ts.model_grads) && first < NL;
  const int64_t G = ts.routers ? ts.routers->settings.groups : 0;
  const bool recompute = opt.force_recompute >= 0
                             ? opt.force_recompute == 1
                             : layer_act_bytes(c, T, G, lora_cols) * (NL - first) > opt.keep_activations_bytes;

  // Forward: xs[l] is layer l's input; xs[NL] the final residual.
  std::vector<std::vector<float>> xs(NL + 1);
  xs[0].resize(T * D);
  embed_tokens(m, w.ids, T, 0, xs[0].data());
  std::vector<BlockActs> kept(need_grad && !recompute ? NL : 0);
  BlockActs scratch;
  auto run_block = [&](int64_t l, float* out, BlockActs& A) {
    BlockIO io;
    io.layer = l;
    io.T = T;
    io.x_in = xs[l].data();
    io.x_out = out;
    block_train_forward(m, plan.at(l), io, A, adapter.get());
  };
  for (int64_t l = 0; l < NL; ++l) {
    xs[l + 1].resize(T * D);
    run_block(l, xs[l + 1].data(), (need_grad && !recompute && l >= first) ? kept[l] : scratch);
    // Inputs of layers below the first trained one are not needed again.
    if (need_grad && l < first) std::vector<float>().swap(xs[l]);
  }

  LossGrad res;
  std::vector<float> dx(need_grad ? T * D : 0);
  res.loss_sum =
      head_loss(m, xs[NL].data(), w, loss_scale, need_grad ? dx.data() : nullptr, &res.scored, ts.model_grads);
  if (!need_grad) return res;

  BlockGradScratch S;
  for (int64_t l = NL - 1; l >= first; --l) {
    BlockActs* A = &scratch;
    if (recompute) {
      std::vector<float> out(T * D);
      run_block(l, out.data(), scratch);
    } else {
      A = &kept[l];
    }
    block_backward(m, plan.at(l), l, T, xs[l].data(), *A, adapter.get(), dx.data(), S,
                   ts.model_grads ? &ts.model_grads->layers[l] : nullptr);
    if (!recompute) kept[l] = BlockActs();
    std::vector<float>().swap(xs[l + 1]);
  }
  if (ts.model_grads) embed_backward(m, w.ids, T, dx.data(), *ts.model_grads);
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
